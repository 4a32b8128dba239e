"""The rollout role: sample n responses per prompt with token log-probs, and take new weights.

Generation itself is the engine's job, chosen by `rollout.name` from the table in
plait/workers/engine.py (plait's own KV-cached decode loop, vLLM, ...). This worker turns prompts
into a `RolloutBatch`, keeps the policy version its weights belong to, and loads weights pushed by
the trainer.

Thread safety (async modes generate in one thread while the trainer syncs weights from another):
`generate`, `resume` and `load_weights` hold one lock, so a weight load waits for a running
generate instead of changing weights under it; `abort()` takes no lock and makes that generate
return at its next token, its unfinished rows marked "aborted" for `resume` to finish.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from plait.config import RolloutConfig, SamplingConfig
from plait.models import eos_token_ids, load_generation_config
from plait.models_vl import is_vl_dir, load_processor
from plait.types import PromptBatch, RolloutBatch
from plait.workers import out_of_band
from plait.workers.engine import ENGINES, PLAIT_ENGINE, EngineArgs
from plait.workers.rollout_engine import SamplingParams


class Rollout:
    def __init__(self, model_path: str, max_response_length: int, tokenizer, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, ignore_eos: bool = False,
                 cfg: RolloutConfig | None = None, colocated: bool = True, agent_cfg=None):
        """`cfg` (the rollout node) names the engine and its settings; None: plait's own engine.
        `agent_cfg`: the whole PlaitConfig when rows run agent loops (plait/agents), else None."""
        self.max_response_length, self.pad_token_id, self.profiler = max_response_length, tokenizer.pad_token_id, profiler
        eos = [] if ignore_eos else eos_token_ids(tokenizer, load_generation_config(model_path))
        self.eos_ids = eos
        self.engine_name = PLAIT_ENGINE if cfg is None else cfg.name
        self.engine_args = EngineArgs(model_path, cfg, dtype, device, eos, ignore_eos, self.pad_token_id, profiler, colocated)
        self.engine = ENGINES[self.engine_name].build(self.engine_args)
        self.version = 0
        self._lock = threading.Lock()
        self.agents = None if agent_cfg is None else _agent_worker(agent_cfg, tokenizer, model_path, eos)
        self.processor = load_processor(model_path) if is_vl_dir(model_path) else None  # images -> pixel values

    def generate(self, prompts: PromptBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        if self.agents is not None and any(prompts.multi_modal):
            raise ValueError("agent loops with images are not implemented (build_lm_trainer refuses them)")
        if self.agents is not None:  # an abort() between or inside turns makes it return; resume() goes on
            with self._lock, self.profiler.annotate("gen"):
                return self.agents.generate(prompts, sampling, self._round(seed), lambda: self.version)
        with self._lock, self.profiler.annotate("gen"):
            return self._generate(prompts, sampling, seed)

    def _round(self, seed: int):
        """One engine batch for the agent loops' scheduler (plait/agents/runner.py); the caller holds the lock."""
        generator = torch.Generator().manual_seed(seed)

        def params(sampling: dict, max_new_tokens: int) -> SamplingParams:
            keys = ("temperature", "top_p", "top_k", "do_sample")  # verl's other keys (logprobs, ...): always on / n.a.
            out = self._params(SamplingConfig(n=1, **{k: sampling[k] for k in keys if k in sampling}), max_new_tokens)
            out.grammar = sampling.get("grammar")  # the gateway's: a forced call, a JSON answer (workers/grammar.py)
            return out

        def engine_round(ids: list[list[int]], max_new_tokens: int, sampling: dict):
            marks = {}  # when the prefill ended (the first decode forward begins), for the requests' timings

            def on_forward(i: int) -> None:
                if i == 1:
                    marks["prefilled"] = time.time()
            # a seeded request (a judge's, plait serve's) samples from its own generator: the same answer every time
            own = torch.Generator().manual_seed(int(sampling["seed"])) if "seed" in sampling else generator
            gen = self.engine.generate(ids, params(sampling, max_new_tokens), generator=own, on_forward=on_forward)
            gen.prefilled = marks.get("prefilled", 0.0)
            return gen
        if not self.engine.continuous:
            return engine_round

        def serve(admit, deliver, stop):  # continuous batching (vLLM) instead of rounds
            return self.engine.serve(lambda: [(r, ids, params(s, budget)) for r, ids, s, budget in admit()],
                                     deliver, stop, generator=generator)
        engine_round.serve = serve
        return engine_round

    def resume(self, batch: RolloutBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        """Finish the rows of `batch` that an abort cut short, from their tokens so far, with the current
        weights. Their earlier tokens keep the log-probs they were sampled with; a finished row takes
        this worker's version (the version that finished it). Other rows are returned unchanged."""
        if self.agents is not None:
            with self._lock, self.profiler.annotate("gen"):
                return self.agents.resume(batch, self._round(seed), lambda: self.version)
        with self._lock, self.profiler.annotate("gen"):
            return self._resume(batch, sampling, seed)

    def _params(self, sampling: SamplingConfig, max_new_tokens: int) -> SamplingParams:
        greedy = not sampling.do_sample or sampling.temperature == 0
        return SamplingParams(max_new_tokens=max_new_tokens,
                              temperature=1.0 if sampling.temperature == 0 else sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, do_sample=not greedy)

    def _resume(self, batch: RolloutBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        rows = [i for i, reason in enumerate(batch.stop_reasons) if reason == "aborted"]
        if not rows:
            return batch
        lengths = batch.attended.sum(-1).long().tolist()                      # [batch]
        ids = [batch.prompts[i][batch.prompt_mask[i].bool()].tolist() + batch.responses[i, :lengths[i]].tolist()
               for i in rows]
        budget = self.max_response_length - min(lengths[i] for i in rows)
        media = None if batch.multi_modal_inputs is None else [batch.multi_modal_inputs[i] for i in rows]
        out = self._engine_generate(ids, self._params(sampling, budget), seed, media)
        grow = (0, self.max_response_length - batch.responses.shape[1])
        responses = F.pad(batch.responses, grow, value=self.pad_token_id)    # [batch, max_response_length]
        mask, logprobs = F.pad(batch.response_mask, grow), F.pad(batch.rollout_logprobs, grow)
        token_versions = F.pad(batch.token_version_map, grow, value=-1)     # the earlier tokens keep theirs
        kept = _grown_kept(batch, out.kept, self.max_response_length)         # None: no filter either time
        versions, reasons = batch.versions.clone(), list(batch.stop_reasons)
        new_lengths = out.response_mask.sum(-1).long().tolist()
        for j, i in enumerate(rows):
            start = lengths[i]
            take = min(new_lengths[j], self.max_response_length - start)  # rows aborted earlier have less room
            responses[i, start:start + take] = out.responses[j, :take].cpu()
            mask[i, start:start + take] = 1.0
            logprobs[i, start:start + take] = out.logprobs[j, :take].float().cpu()
            token_versions[i, start:start + take] = self.version
            if kept is not None and out.kept is not None:
                kept[i, start:start + take, :out.kept.shape[-1]] = out.kept[j, :take].cpu()
            reasons[i] = out.stop_reasons[j] if take == new_lengths[j] else "length"
            versions[i] = self.version
        width = int(mask.sum(-1).max())
        return batch.replace(responses=responses[:, :width], response_mask=mask[:, :width],
                             rollout_logprobs=logprobs[:, :width], versions=versions, stop_reasons=reasons,
                             token_versions=token_versions[:, :width],
                             sampled_from=None if kept is None else kept[:, :width])

    def _engine_generate(self, ids: list[list[int]], params: SamplingParams, seed: int,
                         multi_modal: list[dict] | None = None):
        """`multi_modal`: per prompt {"images": [PIL], "pixel_values", "image_grid_thw"} (each engine reads what
        it takes: the hf engine the processor outputs, vLLM the images); None: text only."""
        generator = torch.Generator().manual_seed(seed)
        media = {} if multi_modal is None else {"multi_modal": multi_modal}
        with self.profiler.decode_steps() as gate:  # profile_token_start/end: which decode steps are traced
            return self.engine.generate(ids, params, generator=generator, on_forward=gate, **media)

    def _media(self, rows: list[dict]) -> list[dict] | None:
        """Per prompt its images and their processor outputs (computed here once per prompt); None: no media."""
        if not rows or not any(rows):
            return None
        if self.processor is None:
            raise ValueError("prompts with images reached a text model's rollout (the dataset refuses them)")
        return [m if not m or "pixel_values" in m else {**m, **self.processor.images(m["images"])} for m in rows]

    def _generate(self, prompts: PromptBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        n = sampling.n
        ids = [p for p in prompts.prompt_ids for _ in range(n)]   # each prompt n times, adjacent
        params = self._params(sampling, self.max_response_length)
        media = self._media(prompts.multi_modal)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        out = self._engine_generate(ids, params, seed, None if media is None else rep(media))
        width = max(len(p) for p in ids)
        prompt_t = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, p in enumerate(ids):
            prompt_t[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, width - len(p):] = 1
        inputs = None if media is None else [{k: v for k, v in m.items() if k != "images"} for m in media]
        return RolloutBatch(
            prompts=prompt_t, prompt_mask=prompt_mask,
            responses=out.responses.cpu(), response_mask=out.response_mask.float().cpu(),
            rollout_logprobs=out.logprobs.float().cpu(),
            group_ids=torch.tensor(rep(prompts.indices), dtype=torch.long),
            versions=torch.full((len(ids),), self.version, dtype=torch.long),
            data_sources=rep(prompts.data_sources), ground_truths=rep(prompts.ground_truths),
            extra_infos=rep(prompts.extra_infos), stop_reasons=list(out.stop_reasons),
            multi_modal_inputs=None if inputs is None else rep(inputs),
            sampled_from=None if out.kept is None else out.kept.cpu())

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, share: bool = False) -> None:
        """`share`: alias tensors of the engine's dtype and device instead of copying (see weight_sync)."""
        with self._lock, self.profiler.annotate("update_weights"):
            self.engine.load_weights(state_dict, share)
            self.version = version

    def restart_engine(self) -> None:
        """A fresh engine in place of one whose process died (EngineDied): the model's initial weights, until
        the trainer pushes the current ones (which it does next)."""
        with self._lock:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - the dead engine's clean-up; the new one is what matters
                pass
            self.engine = ENGINES[self.engine_name].build(self.engine_args)

    def probe_logprobs(self, ids: list[int]) -> list[float] | None:
        """The engine's log-probs of the weight-sync check's probe; None: this engine cannot say (the check is off)."""
        with self._lock:
            return self.engine.probe_logprobs(ids)

    def close(self) -> None:
        """Stop the engine's own processes, if it has any (vLLM's engine core), and the agent loops' tools."""
        if self.agents is not None:
            self.agents.close()
        self.engine.close()

    @out_of_band
    def abort(self) -> None:
        """Cut a running generate or resume short (no lock: it must reach the call holding it)."""
        if self.agents is not None:
            self.agents.abort()
        self.engine.abort()


def _agent_worker(cfg, tokenizer, model_path: str, eos_ids: list[int]):
    """The agent side of this worker: the loops, and the tools of rollout.multi_turn (plait/agents)."""
    from plait.agents.interactions import InteractionBox
    from plait.agents.tools import ToolBox, ToolLimits
    from plait.agents.worker import AgentWorker
    from transformers import AutoConfig
    model_type = AutoConfig.from_pretrained(model_path, local_files_only=True).model_type
    mt = cfg.actor_rollout_ref.rollout.multi_turn  # tools get the limits rewards have (reward.memory_limit_mb, ...)
    limits = ToolLimits(num_workers=mt.tool_num_workers, timeout_s=mt.tool_timeout,
                        memory_limit_mb=cfg.reward.memory_limit_mb, max_processes=cfg.reward.max_processes)
    tools = ToolBox.from_config(mt, limits)
    try:  # interactions run in worker processes as tools do, with the same limits
        interactions = InteractionBox.from_config(mt, limits)
    except BaseException:
        if tools is not None:
            tools.close()
        raise
    return AgentWorker(cfg, tokenizer, model_type, tools, interactions, eos_ids)


def _grown_kept(batch: RolloutBatch, resumed: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The batch's kept sets [batch, length, k] (-1: none yet), wide enough for the resumed tokens' too."""
    if batch.sampled_from is None and resumed is None:
        return None
    kept = batch.sampled_from if batch.sampled_from is not None else torch.full((*batch.responses.shape, 1), -1)
    width = max(kept.shape[-1], 0 if resumed is None else resumed.shape[-1])
    return F.pad(kept, (0, width - kept.shape[-1], 0, length - kept.shape[1]), value=-1)
