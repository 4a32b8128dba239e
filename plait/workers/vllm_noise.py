"""vLLM's known, harmless warnings, each said once in one line instead of at every occurrence.

    RotaryEmbedding: Failed to load weights   after every weight sync (its cos/sin cache is no weight)
    Chat template warmup failed + traceback   at start (plait starts vLLM with skip_tokenizer_init)

vLLM configures logging in each of its processes when it is imported, the engine core (spawned)
included, from VLLM_LOGGING_CONFIG_PATH when VLLM_CONFIGURE_LOGGING=1. `quiet_known_warnings` points
both at vllm_logging.json beside this file: vLLM's warnings and errors as bare lines on stderr (its
INFO lines would drown the step lines), through `KnownWarnings`; and PYTHONWARNINGS leaves out the
resource tracker's shared-memory note at exit. A user who set either vLLM variable keeps their own
logging. Left out: vLLM's profiler op table (printed, not logged); docs/rollout.md explains it.
"""

from __future__ import annotations

import logging
import os

CONFIG = os.path.join(os.path.dirname(__file__), "vllm_logging.json")
# Python's resource tracker at exit: "resource_tracker: There appear to be 1 leaked shared_memory objects
# to clean up at shutdown" for a segment of vLLM's, which it unlinks right then (docs/rollout.md).
TRACKER_NOTE = "ignore:resource_tracker:UserWarning"

# logger name -> (the message's start, the one line that replaces its first occurrence)
KNOWN = {
    "vllm.model_executor.model_loader.reload.layerwise": (
        "%s: Failed to load weights",
        "vLLM: 'RotaryEmbedding: Failed to load weights' after each weight sync is harmless: the rotary "
        "cos/sin cache is rebuilt, not loaded (said once; docs/rollout.md)"),
    "vllm.renderers.base": (
        "Chat template warmup failed",
        "vLLM: its chat template warm-up failed, harmlessly: plait passes token ids (skip_tokenizer_init) "
        "and applies chat templates itself (said once; docs/rollout.md)"),
}


class KnownWarnings(logging.Filter):
    """The first record of each KNOWN warning rewritten to its one line, without its traceback; later ones dropped."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        known = KNOWN.get(record.name)
        if known is None or not str(record.msg).startswith(known[0]):
            return True
        if record.name in self.seen:
            return False
        self.seen.add(record.name)
        record.msg, record.args, record.exc_info, record.exc_text = known[1], (), None, None
        return True


def quiet_known_warnings() -> None:
    """Before vLLM is imported: its processes log through vllm_logging.json, unless the user chose."""
    if "VLLM_CONFIGURE_LOGGING" in os.environ or "VLLM_LOGGING_CONFIG_PATH" in os.environ:
        return
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = CONFIG
    # the resource tracker (a process of its own, started later) reads this at its start
    os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), TRACKER_NOTE) if w)
