"""keep_freed_memory: a large tensor freed and allocated again reuses the heap's pages instead of
faulting fresh ones in from the kernel; a user's own malloc tuning is left alone."""

import os
import platform
import subprocess
import sys

import pytest

from plait.allocator import malloc_setting

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

PAGES = (2 ** 27 + 2 ** 25) // 4096  # a step's 128 + 32 MiB of tensors, in 4 KiB pages

SCRIPT = """
import resource, sys, torch
from plait.allocator import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():  # a step's large temporaries: allocated, every page written, freed
    x, y = torch.ones(2 ** 25), torch.ones(2 ** 23)
    del x, y
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, *faults)
"""


def run(mode: str, **env) -> tuple[bool, list[int]]:
    """(tuned, page faults of each of 10 steps) in a fresh process."""
    clean = {k: v for k, v in os.environ.items() if not malloc_setting(k)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", [int(f) for f in out[1:]]


def huge_pages_always() -> bool:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    return os.path.exists(path) and "[always]" in open(path).read()


def test_freed_memory_is_reused_without_page_faults():
    """The heap grows for the first steps (torch's aligned blocks do not always fit a freed block of their
    own size until freed neighbours coalesce: seen up to 6 steps), then the steps fault nothing."""
    tuned, faults = run("keep")
    assert tuned
    assert sum(faults[-3:]) < PAGES // 20, f"page faults per step {faults} ({PAGES} pages of 4 KiB a step)"
    if not huge_pages_always():  # glibc's default: the blocks are mmapped and faulted in again, page by page
        _, default_faults = run("default")
        assert min(default_faults[-3:]) > PAGES // 2, default_faults


def test_a_users_malloc_tuning_is_left_alone():
    tuned, _ = run("keep", MALLOC_ARENA_MAX="2")
    assert not tuned


GIVE_BACK = """
import sys, torch
from plait.allocator import give_back_freed_memory, keep_freed_memory
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2 ** 20
assert keep_freed_memory()
x = torch.ones(2 ** 26)  # 256 MiB, every page written, then freed: kept in the heap
del x
kept = rss_mib()
give_back_freed_memory()
print(kept - rss_mib())
"""


def test_a_closed_windows_freed_memory_goes_back_to_the_kernel():
    """issue 52: a profiler window's own memory, freed as it closes, stayed resident (the heap keeps freed memory)
    and became every later stage's peak; the session gives it back as the window closes."""
    clean = {k: v for k, v in os.environ.items() if not malloc_setting(k)}
    out = subprocess.run([sys.executable, "-c", GIVE_BACK], env=clean, capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 200, out.stdout  # MiB back of the 256 freed
