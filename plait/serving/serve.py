"""`plait serve MODEL`: the gateway's server without training, to chat with or evaluate a model.

    HTTP (server.py, on an event-loop thread) ──▶ Gateway (calls outside sessions) ──▶ Scheduler queue
    this thread: take what is queued (a 20 ms window after the first request) ──▶ one engine round
                 (hf: rounds of generate; vLLM: its continuous batching) ──▶ answers

MODEL is a training checkpoint (`checkpoints/global_step_N`, or `checkpoints/` for its newest: its policy is
exported to a temporary folder first, as `plait export` would), an exported or any transformers model
folder, or a built-in model name (`smollm2-135m-instruct`). Requests sample as they ask (temperature 0 is
greedy); tool calls are read in the hermes format unless `--tool-format` says otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

WINDOW_S = 0.02  # how long the first queued request waits for others to share its engine round


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, engine: str | None = None, max_tokens: int = 1024,
          tool_format: str = "hermes", ready=None, stop: threading.Event | None = None) -> None:
    """Serve until Ctrl-C (or `stop` is set); `ready(url)` is called once the server listens."""
    import transformers
    from transformers import AutoConfig

    from plait.agents.runner import EventLoopThread, Scheduler, run_round
    from plait.config import RolloutConfig
    from plait.models import load_tokenizer
    from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
    from plait.profiler.session import ProfilerSession
    from plait.serving.gateway import Gateway
    from plait.serving.server import Server
    from plait.workers.rollout import Rollout
    from plait.configtree import ConfigError
    from plait.workers.engine import ENGINES, PLAIT_ENGINE
    stop = stop or threading.Event()
    engine = engine or PLAIT_ENGINE
    if engine not in ENGINES or ENGINES[engine].unavailable():
        why = ENGINES[engine].unavailable() if engine in ENGINES else f"one of {', '.join(ENGINES)}"
        raise ConfigError("--engine", engine, why)
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" for one small file
    with tempfile.TemporaryDirectory(prefix="plait-serve-") as scratch:
        path = model_folder(model, scratch)
        tokenizer = load_tokenizer(path)
        profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
        rollout = Rollout(path, max_tokens, tokenizer, profiler, cfg=RolloutConfig(name=engine))
        queue = Scheduler(max_tokens)
        thread = EventLoopThread()
        name = os.path.basename(model.rstrip("/")) or model
        gateway = Gateway(tokenizer, AutoConfig.from_pretrained(path, local_files_only=True).model_type, tool_format,
                          rollout.eos_ids, name, generate=queue.generate, max_tokens=max_tokens)
        server = Server(gateway, thread.loop, host, port)
        print(f"plait: serving {model} ({engine} engine) at {server.url}/v1 (OpenAI) and {server.url} (Anthropic); "
              "Ctrl-C stops", file=sys.stderr)
        if ready is not None:
            ready(server.url)
        engine_round = rollout._round(seed=0)
        try:
            while not stop.is_set():
                requests = queue.take(lambda: 1 << 30, WINDOW_S, stop.is_set)
                if requests:
                    run_round(requests, engine_round, 0)
        except KeyboardInterrupt:
            pass
        finally:
            server.close()
            thread.close()
            rollout.close()


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
