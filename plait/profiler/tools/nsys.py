"""The `nsys` tool: an NVTX range per stage and a CUDA profiler capture range per window.

The report itself is written by Nsight Systems, which must launch the process with
`--capture-range=cudaProfilerApi` (and `--capture-range-end=repeat` for several windows); plait
does not know its file name, so the manifest record of a window has `path: null`. Needs CUDA and
the `nvtx` package; `validate_environment` refuses the tool otherwise.
"""

from __future__ import annotations

import nvtx
import torch


class NsysTool:
    def __init__(self):
        self._window = None

    def open(self, window) -> None:
        self._window = window
        torch.cuda.profiler.start()

    def stage(self, role: str, stage: str, own_file: bool, scheduled: bool = False):
        return nvtx.annotate(f"{role}/{stage}", domain="plait")

    def close(self) -> None:
        window, self._window = self._window, None
        torch.cuda.synchronize()  # the window's kernels belong inside the capture range
        torch.cuda.profiler.stop()
        window.add(window.name, path=None)
