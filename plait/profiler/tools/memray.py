"""The `memray` tool: host memory by call stack, one memray capture per window and process.

A memray Tracker runs while a window is open and records every allocation the process makes on any
thread (Python and native frames, `native_traces` as verl's tool does), plus its resident memory every
10 ms. It writes as it goes, to a hidden name in the step folder; at window end the tracker is closed
and the capture renamed to `<role>_rank<r>.memray.bin` through `window.save`, so a window that failed
leaves no capture under the artifact's name. memray has no ranges of its own: a stage is a frame of the
stacks it records, and the report sets the capture's memory against the timeline's stages.
`plait profile report` runs `memray flamegraph` on each capture and links the page it writes.

memray allows one tracker per process (`pytest --memray`, `memray run` hold one too): a window that
cannot start its tracker is reported and marked incomplete, as any tool's failure is. An engine in a
process of its own (vLLM's engine core) is not followed.
"""

from __future__ import annotations

import contextlib
import os

import memray

from plait.profiler.naming import MEMRAY_EXT as EXT, artifact_path


class MemrayTool:
    def __init__(self):
        self._window = None
        self._tracker: memray.Tracker | None = None
        self._file = ""

    def open(self, window) -> None:
        final = artifact_path(window.save_path, window.first, window.last, window.name, window.rank, ext=EXT)
        folder = os.path.dirname(final)
        self._file = os.path.join(folder, f".rec-{os.getpid()}-{os.path.basename(final)}")
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(self._file):  # memray will not overwrite: a killed run's leftover
            os.remove(self._file)
        tracker = memray.Tracker(self._file, native_traces=True)
        tracker.__enter__()
        self._window, self._tracker = window, tracker

    def stage(self, role: str, stage: str, own_file: bool, scheduled: bool = False):
        return contextlib.nullcontext()

    def close(self) -> None:
        window, tracker, self._window, self._tracker = self._window, self._tracker, None, None
        try:
            tracker.__exit__(None, None, None)
        finally:
            # Moved even after a failed exit: whatever memray flushed is still a capture to read.
            window.save(window.name, EXT, lambda path: os.replace(self._file, path))

