"""A model behind the gateway's server without training: `plait serve MODEL`, and a judge's replica.

    HTTP (server.py, on an event-loop thread) ──▶ Gateway (calls outside sessions) ──▶ Scheduler queue
    engine thread: take what is queued (a window after the first request, at most max_num_seqs) ──▶ one
                   engine round (hf: a batch of generate; vLLM: its continuous batching) ──▶ answers

`ModelServer` is that whole: the engine (a Rollout worker's, chosen by a rollout node), the server on
127.0.0.1 unless told otherwise, and the thread that runs engine rounds, each round recorded (wall clock,
requests, tokens) for whoever accounts for the server's time (a judge's stage, plait/workers/judge.py).
A round the engine fails answers its requests with a 500 naming the error (said once on stderr) and the thread
goes on to the next, so no caller waits on a dead round. A prompt is bounded by the model's context
(`max_position_embeddings` unless told a smaller one). `serve` runs one until Ctrl-C.

MODEL is a training checkpoint (`checkpoints/global_step_N`, or `checkpoints/` for its newest: its policy is
exported to a temporary folder first, as `plait export` would), an exported or any transformers model
folder, or a built-in model name (`smollm2-135m-instruct`). Requests sample as they ask (temperature 0 is
greedy); tool calls are read in the hermes format unless `--tool-format` says otherwise.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

WINDOW_S = 0.02  # how long the first queued request waits for others to share its engine round


@dataclass
class EngineRound:
    """One engine round of a served model (what its engine thread took from the queue at once; seeded requests in
    it run an engine call each): wall-clock start and end, its requests and their tokens."""
    start: float
    end: float
    requests: int
    prompt_tokens: int
    response_tokens: int


class ModelServer:
    """A model's engine behind the gateway's server (calls outside sessions), with its engine thread."""

    def __init__(self, path: str, cfg, profiler, name: str, device: str = "cpu", dtype=None, host: str = "127.0.0.1",
                 port: int = 0, max_tokens: int = 1024, tool_format: str = "hermes", defaults: dict | None = None,
                 seed: int | None = None, context: int | None = None, max_num_seqs: int | None = None,
                 window_s: float = WINDOW_S, stage: str = "serve", tinker_dir: str | None = None, limits=None,
                 output_dir: str | None = None, tinker_batch_tokens: int | None = None):
        """`cfg`: the rollout node naming the engine and its settings; `profiler`: the role's handle (each round is
        its `stage`); `limits`: the server's (plait/serving/server.py's Limits); the rest: Gateway's (`max_tokens` the
        default budget, `context` prompt + answer). `tinker_dir`: serve the Tinker training API too
        (plait/serving/tinker), its checkpoints in that folder; `tinker_batch_tokens` the most padded tokens of one of
        its forward / backward passes (None: its default). `output_dir`: the process's timeline goes to its
        timeline.jsonl (the Tinker jobs' spans; `plait profile report output_dir` reads it) until close."""
        import torch
        from transformers import AutoConfig

        from plait.agents.runner import EventLoopThread, Scheduler
        from plait.models import load_tokenizer
        from plait.serving.gateway import Gateway, grammars_for
        from plait.serving.server import Server
        from plait.workers.rollout import Rollout
        tokenizer = load_tokenizer(path)
        self.rollout = Rollout(path, max_tokens, tokenizer, profiler, device=device, dtype=dtype or torch.float32, cfg=cfg)
        self.profiler, self.stage, self.window_s, self.max_num_seqs = profiler, stage, window_s, max_num_seqs
        self.queue = Scheduler(context or max_tokens)
        self.rounds: collections.deque[EngineRound] = collections.deque(maxlen=1 << 16)
        self.in_round = threading.Lock()  # held from a round's start until it is recorded
        self.stopped = threading.Event()
        self.loop = EventLoopThread()
        model = AutoConfig.from_pretrained(path, local_files_only=True)
        # (not every architecture names its context so: those keep the bound they were given)
        bounds = [c for c in (context, getattr(model.get_text_config(), "max_position_embeddings", None)) if c]
        context = min(bounds) if bounds else None
        self.failed: set[str] = set()  # the kinds of engine error said (once each: a dead engine fails every round)
        grammars, no_grammar = grammars_for(self.rollout.engine_name, tokenizer, self.rollout.eos_ids)
        self.gateway = Gateway(tokenizer, model.model_type, tool_format, self.rollout.eos_ids, name, generate=self.queue.generate,
                               max_tokens=max_tokens, defaults=defaults, seed=seed, context=context,
                               grammars=grammars, no_grammar=no_grammar)
        self.tinker = None
        from plait.profiler.timeline import TIMELINE, TIMELINE_FILE
        self.timeline = output_dir is not None and TIMELINE.path is None  # else the process's open one (a run's) keeps it
        if self.timeline:
            TIMELINE.open(os.path.join(output_dir, TIMELINE_FILE))
        try:
            if tinker_dir is not None:
                from plait.serving.tinker import tinker_api
                from plait.serving.tinker.routes import tinker_routes
                self.tinker = tinker_api(path, name, tokenizer, self.rollout.eos_ids, tinker_dir, max_tokens, cfg,
                                         profiler, tinker_batch_tokens)
            self.server = Server(self.gateway, self.loop.loop, host, port,
                                 tinker_routes(self.tinker) if self.tinker is not None else None, limits)
        except BaseException:
            if self.tinker is not None:
                self.tinker.close()
            self.loop.close()
            self.rollout.close()
            self._close_timeline()
            raise
        self.engine = threading.Thread(target=self._run, name=f"plait-{stage}-engine", daemon=True)
        self.engine.start()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def address(self) -> str:
        """host:port, as verl hands a reward function its `reward_router_address`."""
        return self.server.url.removeprefix("http://")

    def _run(self) -> None:
        from plait.agents.runner import run_round
        engine_round = self.rollout._round(seed=0)
        while not self.stopped.is_set():
            requests = self.queue.take(lambda: 1 << 30, self.window_s, self.stopped.is_set, self.max_num_seqs)
            if not requests:
                continue
            with self.in_round:
                start = time.time()
                try:
                    with self.profiler.annotate(self.stage):
                        run_round(requests, engine_round, 0)
                except Exception as err:  # noqa: BLE001 - the engine's own error: its callers get it, the server goes on
                    self._fail(requests, err)
                    continue
                self.rounds.append(EngineRound(start, time.time(), len(requests),
                                               sum(len(r.prompt_ids) for r in requests), sum(len(r.tokens) for r in requests)))

    def _fail(self, requests: list, err: Exception) -> None:
        """Answer a failed round's requests with the engine's error (a 500 in the API's shape), said once a kind."""
        from plait.serving.protocol import ApiError
        why = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        if type(err).__name__ not in self.failed:
            self.failed.add(type(err).__name__)
            print(f"plait: the {self.stage} engine failed a round of {len(requests)} request(s) ({why}); they are "
                  "answered 500 and the server goes on", file=sys.stderr)
        for r in requests:
            r.loop.call_soon_threadsafe(_fail_future, r.future, ApiError(
                500, f"the model's engine failed this request: {why}", kind="server_error"))

    def rounds_since(self, since: float) -> list[EngineRound]:
        """The engine rounds that ended after `since` (wall clock). A round whose answers went out is recorded
        a moment later: a running round is waited for (at most 10 s), so a caller holding its answers finds it."""
        if self.in_round.acquire(timeout=10):
            self.in_round.release()
        return [r for r in list(self.rounds) if r.end > since]

    def close(self) -> None:
        self.stopped.set()
        self.queue.notify()
        self.engine.join(timeout=30)
        self.server.close()
        if self.tinker is not None:
            self.tinker.close()
        self.loop.close()
        self.rollout.close()
        self._close_timeline()

    def _close_timeline(self) -> None:
        if self.timeline:
            from plait.profiler.timeline import TIMELINE
            TIMELINE.close(self.tinker.steps if self.tinker is not None else 0)
            self.timeline = False


def _fail_future(future, err: Exception) -> None:
    if not future.done():
        future.set_exception(err)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, engine: str | None = None, max_tokens: int = 1024,
          tool_format: str = "hermes", ready=None, stop: threading.Event | None = None, name: str | None = None,
          tinker_dir: str | None = None, max_body_mb: float = 8, output_dir: str | None = None,
          tinker_batch_tokens: int | None = None) -> None:
    """Serve until Ctrl-C (or `stop` is set); `ready(url)` is called once the server listens. `tinker_dir`: the
    Tinker API too (plait/serving/tinker), its checkpoints there; off, with a line saying so, without its packages.
    `output_dir`: where timeline.jsonl goes (default: `tinker_dir`; with neither, no timeline). `tinker_batch_tokens`:
    the most padded tokens in one Tinker forward / backward pass (a larger request runs in pieces)."""
    import transformers

    from plait.config import RolloutConfig
    from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
    from plait.profiler.session import ProfilerSession
    from plait.configtree import ConfigError
    from plait.serving.server import Limits
    from plait.workers.engine import ENGINES, PLAIT_ENGINE
    own_process = stop is None  # the CLI's `plait serve`, stopped by a signal: its exit is bounded (SHUTDOWN_S)
    stop = stop or threading.Event()
    if not max_body_mb > 0:
        raise ConfigError("--max-body-mb", max_body_mb, "a size in MiB > 0")
    if tinker_batch_tokens is not None and tinker_batch_tokens < 1:
        raise ConfigError("--tinker-batch-tokens", tinker_batch_tokens, "a number of tokens >= 1")
    engine = engine or PLAIT_ENGINE
    if engine not in ENGINES or ENGINES[engine].unavailable():
        why = ENGINES[engine].unavailable() if engine in ENGINES else f"one of {', '.join(ENGINES)}"
        raise ConfigError("--engine", engine, why)
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" for one small file
    with tempfile.TemporaryDirectory(prefix="plait-serve-") as scratch:
        path = model_folder(model, scratch)
        profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
        name = name or os.path.basename(model.rstrip("/")) or model
        missing = [p for p in ("tinker", "peft") if importlib.util.find_spec(p) is None]
        if tinker_dir is not None and missing:
            print(f"plait: serve: the Tinker API is off: it needs {' and '.join(missing)} "
                  "(pip install 'plait[tinker]')", file=sys.stderr)
            tinker_dir = None
        output_dir = output_dir or tinker_dir
        server = ModelServer(path, RolloutConfig(name=engine), profiler, name, host=host, port=port,
                             max_tokens=max_tokens, tool_format=tool_format, tinker_dir=tinker_dir,
                             limits=Limits(max_body_bytes=int(max_body_mb * (1 << 20))), output_dir=output_dir,
                             tinker_batch_tokens=tinker_batch_tokens)
        tinker = f", Tinker at {server.url} as base_model {name!r} (checkpoints in {tinker_dir})" if tinker_dir else ""
        print(f"plait: serving {model} ({engine} engine) at {server.url}/v1 (OpenAI) and {server.url} (Anthropic)"
              f"{tinker}; timeline in {output_dir or 'none (--output-dir)'}; Ctrl-C stops", file=sys.stderr)
        if ready is not None:
            ready(server.url)
        if own_process:
            stop_on_signals()
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            if own_process:  # Ctrl-C stops, whatever a thread waits on (never armed in a caller's process)
                watchdog = threading.Timer(SHUTDOWN_S, stuck_shutdown)
                watchdog.daemon = True
                watchdog.start()
            server.close()


SHUTDOWN_S = 20.0  # `plait serve` exits this long after a stop at the latest


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM stop `plait serve`, also when it was started with SIGINT ignored: a script's `plait serve &`
    inherits that, and Python then leaves SIGINT ignored (such a server outlived its SIGINT in a CI rehearsal)."""
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def stuck_shutdown() -> None:
    """The server's shutdown (or the interpreter's after it) outlived SHUTDOWN_S: say so with every thread's stack,
    then exit 130."""
    import faulthandler
    print(f"plait: serve: still shutting down after {SHUTDOWN_S:.0f} s; exiting now. Its threads:", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(130)


def model_folder(model: str, scratch: str) -> str:
    """A transformers folder for MODEL: a checkpoint's policy exported into `scratch`, a built-in model built,
    or the folder itself. Raises FileNotFoundError with the line to print."""
    from plait.builtin_models import builtin_model
    from plait.export import ExportError, export_checkpoint
    built = builtin_model(model)
    if built is not None:
        built.check("model", model)
        return built.build()
    if not os.path.isdir(model):
        raise FileNotFoundError(f"{model}: no such folder (a checkpoint, an exported model folder or a built-in "
                                "model name such as smollm2-135m-instruct)")
    checkpoint = os.path.isdir(os.path.join(model, "actor")) or os.path.isfile(
        os.path.join(model, "latest_checkpointed_iteration.txt"))  # a step folder, or checkpoints/
    if not checkpoint:
        return model
    try:
        return export_checkpoint(model, os.path.join(scratch, "policy"))
    except ExportError as err:
        raise FileNotFoundError(f"{model}: a checkpoint plait cannot export: {err}") from None
