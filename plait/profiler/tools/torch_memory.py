"""The `torch_memory` tool: what held memory during a window.

On CUDA: the caching allocator's history is recorded only while a window is open
(`_record_memory_history`, at most `trace_alloc_max_entries` events, `context` and `stacks` as
configured, `kw_args` passed on), dumped as a
snapshot pickle at window end for pytorch.org/memory_viz, then switched off, which also clears
it, so each snapshot covers exactly one window. PyTorch has no stack-depth option, so
`stack_depth` is applied when writing: each event keeps its innermost `stack_depth` Python frames
(and the C++ frames among them, with stacks=all). An
out-of-memory error inside a window dumps `<name>_oom.pickle` before the error propagates; one
outside any window (on a rank that profiles) dumps the allocator's snapshot and memory_summary()
under `<save_path>/oom/`, listed in the manifest when the run closes its profiler.
Stage ranges are recorded as annotations in the snapshot.

Without CUDA there is no allocator history; the window instead gets a torch.profiler trace with
profile_memory, record_shapes and with_stack (see tools/torch.py): every CPU allocation and free with its
size and running total, a "memory allocated (cpu)" counter track, and the stage ranges. The
CUDA-only knobs then do nothing, which `validate_environment` says in one line.
"""

from __future__ import annotations

import logging
import pickle
from typing import Callable, Optional

import torch
from torch.profiler import record_function

from plait.profiler.config import TorchMemoryToolConfig
from plait.profiler.tools.torch import TorchTool

log = logging.getLogger("plait.profiler")


def torch_memory_tool(cfg: TorchMemoryToolConfig):
    if torch.cuda.is_available():
        return CudaMemoryHistory(cfg)
    # Stacks too: the report charges each allocation to the innermost frame outside torch.
    return TorchTool({"memory", "shapes", "stack"}, discrete=False, cuda=False)


class CudaMemoryHistory:
    def __init__(self, cfg: TorchMemoryToolConfig):
        self.cfg = cfg
        self._window = None

    def open(self, window) -> None:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=self.cfg.context, stacks=self.cfg.stacks,
            max_entries=self.cfg.trace_alloc_max_entries,
            **{"clear_history": True, "global_record_annotations": True, **self.cfg.kw_args})
        self._window = window
        _OomObserver.attach()
        _OomObserver.dump = lambda: window.save(window.name, "pickle", self._write, stage="oom")

    def stage(self, role: str, stage: str, own_file: bool, scheduled: bool = False):
        return record_function(f"{role}/{stage}")

    def close(self) -> None:
        _OomObserver.dump = None
        window, self._window = self._window, None
        try:
            window.save(window.name, "pickle", self._write)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)  # stop and clear the history

    def _write(self, path: str) -> None:
        snapshot = trim_frames(torch.cuda.memory._snapshot(), self.cfg.stack_depth)
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)


def trim_frames(snapshot: dict, depth: int) -> dict:
    """Keep the frames of every block and trace event up to its `depth`-th Python frame (frames are
    innermost first); counting C++ frames would leave only allocator internals with stacks=all."""
    items = [b for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])]
    items += [e for trace in snapshot.get("device_traces", []) for e in trace]
    for item in items:
        if "frames" in item:
            item["frames"] = _upto_python_frames(item["frames"], depth)
    return snapshot


def _upto_python_frames(frames: list[dict], depth: int) -> list[dict]:
    seen = 0
    for i, frame in enumerate(frames):
        seen += str(frame.get("filename", "")).endswith(".py")
        if seen == depth:
            return frames[:i + 1]
    return frames


def write_oom_dump(snapshot_path: str, summary_path: str, depth: int) -> None:
    """The allocator's state at an out-of-memory error: its snapshot (segments and blocks; history
    only inside a window) and the text of torch.cuda.memory_summary()."""
    snapshot = trim_frames(torch.cuda.memory._snapshot(), depth)
    with open(snapshot_path, "wb") as f:
        pickle.dump(snapshot, f)
    with open(summary_path, "w") as f:
        f.write(torch.cuda.memory_summary())


class _OomObserver:
    """Forwards CUDA out-of-memory to the open window's dump, or outside windows to the session's.

    Process-wide on purpose: the allocator's observer cannot be detached, so it is attached once
    per process and does nothing while neither is set.
    """

    dump: Optional[Callable[[], None]] = None      # the open window's
    outside: Optional[Callable[[], None]] = None   # the session's, for an OOM between windows
    attached = False

    @classmethod
    def attach(cls) -> None:
        if cls.attached:
            return
        cls.attached = True
        # A private API, present in CUDA builds of recent PyTorch; without it the failure-path
        # snapshot at window close still records the "oom" event.
        if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
            log.warning("torch_memory: this PyTorch build has no CUDA OOM observer; "
                        "no separate snapshot is taken at out-of-memory")
            return
        torch._C._cuda_attach_out_of_memory_observer(cls._on_oom)

    @classmethod
    def _on_oom(cls, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if cls.dump is not None:
            cls.dump()
        elif cls.outside is not None:
            cls.outside()
