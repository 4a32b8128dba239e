"""keep_freed_memory: a large tensor freed and allocated again reuses the heap's pages instead of
faulting fresh ones in from the kernel; a user's own malloc tuning is left alone."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

PAGES = 2 ** 27 // 4096  # a 128 MiB tensor's 4 KiB pages

SCRIPT = """
import resource, sys, torch
from plait.workers.allocator import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():  # a step's large temporary: allocated, every page written, freed
    x = torch.ones(2 ** 25)
    del x
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run(mode: str, **env) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def huge_pages_always() -> bool:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    return os.path.exists(path) and "[always]" in open(path).read()


def test_freed_memory_is_reused_without_page_faults():
    tuned, faults = run("keep")
    assert tuned
    assert faults < PAGES // 20, f"{faults} page faults re-allocating a 128 MiB tensor ({PAGES} pages)"
    if not huge_pages_always():  # glibc's default: the block is mmapped and faulted in again, page by page
        _, default_faults = run("default")
        assert default_faults > PAGES // 2, default_faults


def test_a_users_malloc_tuning_is_left_alone():
    tuned, _ = run("keep", MALLOC_ARENA_MAX="2")
    assert not tuned
