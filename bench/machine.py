"""Is the machine quiet enough that a benchmark measures plait, not its neighbours?

Every benchmark records the 1-minute load average before and after each run. A run is valid when
the load before it is at most cores/2 + 0.5 (on 2 cores: 1.5 — the previous run's own process
decays there within a minute) and after it at most that plus the threads the run used itself.
Invalid runs stay in the results, marked, and the result as a whole says `valid: false`.

Every benchmark also records the host's matmul capability (`capability`): the CPU's SIMD/matrix
flags, torch's CPU kernel level and the measured matmul peak per dtype, so that numbers from hosts
with and without fast bfloat16 (AMX, AVX-512 BF16) are never compared blind.
"""

from __future__ import annotations

import os
import platform
import time


def busy_limit(cores: int | None = None) -> float:
    return (cores or os.cpu_count() or 1) * 0.5 + 0.5


def measured(fn, *args, threads: int = 1, **kwargs) -> tuple[object, dict]:
    """Run fn(*args, **kwargs); return its result and the load record around it."""
    before = os.getloadavg()[0]
    out = fn(*args, **kwargs)
    after = os.getloadavg()[0]
    limit = busy_limit()
    return out, {"load_before": round(before, 2), "load_after": round(after, 2), "busy_limit": limit,
                 "valid": before <= limit and after <= limit + threads}


def wait_quiet(max_wait_s: float = 90.0) -> float:
    """Wait (at most max_wait_s) for the load average to fall under the limit; return it."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > busy_limit() and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def verdict(loads: list[dict]) -> dict:
    """The whole result's validity from its runs' load records; prints a warning when busy."""
    bad = [i for i, r in enumerate(loads) if not r["valid"]]
    if bad:
        print(f"INVALID: the machine was busy during {len(bad)} of {len(loads)} runs (load average over "
              f"{busy_limit()}); these numbers measure contention, not plait. Rerun on a quiet machine.", flush=True)
    return {"valid": not bad, "busy_runs": bad, "busy_limit": busy_limit(),
            "load_max": max((max(r["load_before"], r["load_after"]) for r in loads), default=None)}


# the flags that decide how fast float32 and bfloat16 matmuls run on x86 (AMX, AVX-512, AVX2)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_fp16")


def capability(device: str = "cpu", dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """The host's matmul capability: CPU model and flags, torch's CPU capability, the measured peak
    (a 1024² matmul, best of 5: plait/workers/flops.py, what MFU divides by) per dtype, the GPU if any."""
    import torch
    from plait.workers.flops import device_peak_flops
    flags, model = set(), platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        text = open("/proc/cpuinfo").read()
        flags = set(next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), []))
        model = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), model)
    out = {"cpu_model": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags],
           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "matmul_peak_gflops": {d: round(device_peak_flops(device, getattr(torch, d)) / 1e9, 1) for d in dtypes}}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
