"""Which dtype the workers compute in, and mixed precision verl's way.

`dtype: auto` (actor_rollout_ref.model.dtype, rollout.dtype) resolves once per device: bfloat16 on a
CUDA device that supports it; on a CPU, bfloat16 when a small matmul measured at start runs faster in
bfloat16 than in float32 (an AMX or AVX-512 BF16 host: several times; an AVX2 host: many times slower),
else float32. The flags in /proc/cpuinfo are not trusted alone: what counts is the kernel torch runs.

The trained and the reference models keep float32 weights (verl's `fsdp_config.model_dtype: fp32`),
so the optimizer's state and its step are float32; their forwards run in the compute dtype: under
FSDP2 by its MixedPrecisionPolicy, otherwise (one process, whole replicas) under torch.autocast. The
LM head, its log-softmax and the losses stay float32 (plait/workers/logprobs.py).

Left out: float16 loss scaling (verl's ShardedGradScaler); float16 trains without it.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from plait.workers.flops import device_peak_flops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_MARGIN = 1.2   # bfloat16 must beat float32 by this factor to be chosen: the probe is short and noisy
PROBE_SIZE = 256    # ~34 MFLOP a matmul: milliseconds even where bf16 runs at 1 GFLOP/s (AVX2)


@functools.cache
def auto_dtype(device: str) -> tuple[str, str]:
    """('bfloat16' or 'float32', why) for `device`, measured once per process."""
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"{torch.cuda.get_device_name(device)} computes bfloat16 natively"
        return "float32", f"{torch.cuda.get_device_name(device)} has no bfloat16 support"
    if device != "cpu":
        return "float32", f"no bfloat16 probe for device {device}"
    f32, bf16 = (device_peak_flops(device, dtype, size=PROBE_SIZE) for dtype in (torch.float32, torch.bfloat16))
    measured = (f"a {PROBE_SIZE}x{PROBE_SIZE} matmul ran {bf16 / 1e9:.1f} GFLOP/s in bfloat16 vs {f32 / 1e9:.1f} in float32 "
                f"(torch CPU capability {torch.backends.cpu.get_cpu_capability()})")
    return ("bfloat16", measured) if bf16 >= AUTO_MARGIN * f32 else ("float32", measured)


def resolve_dtype(key: str, value: str, device: str) -> torch.dtype:
    """The torch dtype of config `key`'s `value`; `auto` says in one line which one it chose and why, and
    an explicit bfloat16 or float16 on a CPU that computes it far slower than float32 (an AVX2 host: ~50x)
    says so once, with the measurement: the run does what it was asked, knowingly."""
    if value != "auto":
        if device == "cpu" and value != "float32":
            slow = slow_on_cpu(value)
            if slow is not None:
                print(f"plait: warning: {key}={value} on this CPU: {slow}; {key}=auto picks the faster one",
                      file=sys.stderr)
        return DTYPES[value]
    name, why = auto_dtype(device)
    print(f"plait: {key}=auto -> {name} on {device}: {why}", file=sys.stderr)
    return DTYPES[name]


@functools.cache
def slow_on_cpu(name: str) -> str | None:
    """The measurement, when a matmul in dtype `name` runs over SLOW_FACTOR times slower than in float32 here."""
    f32, other = (device_peak_flops("cpu", dtype, size=PROBE_SIZE) for dtype in (torch.float32, DTYPES[name]))
    if other * SLOW_FACTOR >= f32:
        return None
    return (f"a {PROBE_SIZE}x{PROBE_SIZE} matmul runs {other / 1e9:.1f} GFLOP/s in {name} vs {f32 / 1e9:.1f} in float32, "
            f"{f32 / max(other, 1.0):.0f}x slower (torch CPU capability {torch.backends.cpu.get_cpu_capability()}: "
            "no AMX or AVX-512 BF16/FP16 kernels)")


SLOW_FACTOR = 3  # an explicit dtype this many times slower than float32 is said at start


def compute_autocast(device: str, dtype: torch.dtype, sharded: bool):
    """torch.autocast to `dtype` for an unsharded model's forwards (FSDP2 casts by its policy instead);
    nothing in float32."""
    if sharded or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def role_dtype(mixed_precision, model_dtype: torch.dtype) -> torch.dtype:
    """A role's compute dtype: its fsdp_config.mixed_precision.param_dtype, else the model's."""
    from plait.config import MP_DTYPES
    return model_dtype if mixed_precision.param_dtype is None else DTYPES[MP_DTYPES[mixed_precision.param_dtype]]


def cast_buffers(model, mixed_precision) -> None:
    """Floating-point buffers (rotary frequencies) in mixed_precision.buffer_dtype, float32 by default."""
    from plait.config import MP_DTYPES
    dtype = DTYPES[MP_DTYPES[mixed_precision.buffer_dtype or "float32"]]
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.to(dtype))
