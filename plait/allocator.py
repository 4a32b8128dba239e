"""Host memory that is freed stays with the process: glibc's malloc, tuned once per process on CPU.

A training step on CPU allocates and frees the same large tensors every step (a chunk's logits,
32 MiB; a [vocab, hidden] head gradient, 113 MiB for SmolLM2). glibc serves blocks over its mmap
threshold (at most 32 MiB) with a fresh mmap and gives them back to the kernel when freed, and
trims the heap's top when 128 KiB-64 MiB of it is free: every step then faults its pages in again,
one 4 KiB page at a time, each zeroed by the kernel: the SmolLM2 preset's first 8 steps spent a
tenth (float32) to a sixth (bfloat16) of their CPU time in the kernel, and ran 1.00-1.08x faster with the
memory kept, its kernel time down by a fifth to a third (docs/benchmarks.md, "Host memory").

`keep_freed_memory` turns both off (`mallopt`: no mmap for the main heap, trim only past 2 GiB
free), so the heap grows over the first steps and is then reused (it takes a few: torch's 64-byte
aligned blocks fit a freed block of their own size only once freed neighbours coalesce; up to 6
steps in tests/workers/test_allocator.py's pattern, with glibc 2.36). The resident size stays at
that peak between steps, which is what the next step needs anyway. Left alone where the user tuned malloc
(MALLOC_* or GLIBC_TUNABLES in the environment), on a C library other than glibc, and on GPUs
(device memory has its own caching allocator).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2 ** 31 - 1  # mallopt takes an int: trim the heap only when over 2 GiB of its top is free

_done: bool | None = None
_libc = None


def keep_freed_memory() -> bool:
    """Tune this process's malloc as above, once; True when it is (now or before) in effect."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def give_back_freed_memory() -> None:
    """The heap's free memory back to the kernel (malloc_trim), where keep_freed_memory keeps it: called as a
    profiler window closes, whose recording and trace export freed far more than a step uses; kept, it stayed
    resident and became every later stage's peak (0.51 -> 0.64 GB on the tiny model). The next step then
    faults its own working set back in, as the first steps do."""
    if _done and _libc is not None:
        _libc.malloc_trim(0)


def malloc_setting(name: str) -> bool:
    """Whether environment variable `name` tunes glibc's malloc (then plait leaves it alone)."""
    return name.startswith("MALLOC_") or name == "GLIBC_TUNABLES"


def user_tuned() -> bool:
    return any(malloc_setting(k) for k in os.environ)


def _tune() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_tuned():
        return False
    global _libc
    try:
        libc = _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success; the mmap limit first: a heap that may not trim but still mmaps gains nothing
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
