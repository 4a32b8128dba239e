"""Model FLOPs utilisation: how far a stage runs from the machine's matmul limit.

FLOPs per token follow the PaLM accounting: a forward costs 2N + 4·layers·hidden·context (N: the
weights of every linear layer, the LM head included; the second term is attention's QK^T and AV),
a training step three forwards. The device peak is measured once per process with a square
matmul at the model's dtype (or given), so MFU here means "share of what this device's matmuls
reach", on a CPU as on a GPU. Left out: embeddings, norms, softmax (not matmuls).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch


@functools.cache
def device_peak_flops(device: str, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` [size x size] matmuls on `device` (measured once, cached)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


@dataclass
class ModelFlops:
    params: int        # weights of the linear layers (matmul FLOPs are 2 per weight per token)
    layers: int
    hidden: int
    peak: float        # device FLOP/s

    @classmethod
    def of(cls, model, peak: float | None = None, dtype: torch.dtype | None = None) -> "ModelFlops":
        """`dtype`: the dtype the matmuls run in (mixed precision: the compute dtype, not the weights')."""
        p = next(model.parameters())
        params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        cfg = model.config.get_text_config()  # a VL model: its language model (the vision tower counts in params)
        return cls(params, cfg.num_hidden_layers, cfg.hidden_size,
                   peak or device_peak_flops(str(p.device), dtype or p.dtype))

    def forward(self, lengths: list[int]) -> float:
        """FLOPs of one forward over sequences of these lengths (each attends to its own prefix)."""
        return sum(2 * self.params * n + 2 * self.layers * self.hidden * n * n for n in lengths)

    def training(self, lengths: list[int]) -> float:
        return 3 * self.forward(lengths)

    def mfu(self, flops: float, seconds: float) -> float:
        return flops / max(seconds, 1e-9) / self.peak
