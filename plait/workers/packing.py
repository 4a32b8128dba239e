"""Packed sequences and token-balanced micro-batches for the training roles' forward/backward.

- `micro_batches`: which rows go together. Fixed: consecutive chunks of `micro_batch_size` rows.
  Dynamic (`use_dynamic_bsz`): rows binned by real-token count under a budget
  (`*_max_token_len_per_gpu`), longest first onto the lightest bin, so micro-batches cost about
  the same. Losses are normalised by the mini-batch's token/sequence counts, not the
  micro-batch's, so any partition gives the same gradient.
- `pack` / `unpack` (`use_remove_padding`): the real tokens of a micro-batch packed into rows
  with positions restarting at 0 per sequence and no attention mask. transformers then builds a
  block-diagonal causal mask from the position jumps (masking_utils.find_packed_sequence_indices;
  flash-attention kernels read the same positions as varlen boundaries), so padding costs
  (almost) nothing and results equal the padded forward's.

Rows are [left-padded prompt | right-padded response], so each row's real tokens are contiguous.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from plait.models_vl import is_vl, vl_inputs
from plait.types import RolloutBatch


@dataclass
class MicroBatching:
    """How a role splits and lays out the rows of one forward/backward pass."""
    micro_batch_size: int | None         # rows per micro-batch (fixed sizes); None: the whole batch
    max_token_len: int | None = None     # use_dynamic_bsz: real-token budget per micro-batch instead
    remove_padding: bool = False         # use_remove_padding: pack each micro-batch's real tokens

    def split(self, batch: RolloutBatch) -> list[list[int]]:
        return micro_batches(batch.attention_mask.sum(-1).tolist(), self.micro_batch_size, self.max_token_len)


def micro_batches(lengths: list[int], micro_batch_size: int | None, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch. `max_tokens` None: fixed size (None: all rows at once); else
    token-budget bins.

    A row longer than the budget gets a bin of its own (it cannot be split)."""
    rows = list(range(len(lengths)))
    if max_tokens is None:
        size = micro_batch_size or max(len(rows), 1)
        return [rows[i:i + size] for i in range(0, len(rows), size)]
    order = sorted(rows, key=lambda r: -lengths[r])
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while True:  # fewest bins whose longest-first greedy fill stays under the budget
        bins, load = [[] for _ in range(k)], [0] * k
        for r in order:
            b = min(range(k), key=load.__getitem__)
            bins[b].append(r)
            load[b] += lengths[r]
        if k >= len(rows) or all(l <= max_tokens or len(b) == 1 for b, l in zip(bins, load)):
            return [sorted(b) for b in bins if b]
        k += 1


@dataclass
class Packed:
    """A micro-batch's real tokens packed into rows, and where each came from."""
    input_ids: torch.Tensor      # [rows, row_len]
    position_ids: torch.Tensor   # [rows, row_len], restarting at 0 per sequence
    source: torch.Tensor         # [T] each real token's place in the flat padded [batch * len]
    target: torch.Tensor         # [T] its place in the flat packed [rows * row_len]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Sequences first-fit (longest first) into rows as long as the longest one.

    Rows of that length rather than one long row: a kernel without varlen support (sdpa on CPU)
    computes attention over the whole row, so one row of T tokens costs T^2; these rows cost no
    more than the padded batch's. A row's unused tail is pad tokens counted as one more sequence
    (positions from 0): it attends only to itself and is never read back."""
    lengths = attention_mask.sum(-1).tolist()                               # [batch]
    row_len, width = int(max(lengths)), attention_mask.shape[1]
    rows, free = [], []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        r = next((r for r, f in enumerate(free) if f >= lengths[b]), len(rows))
        if r == len(rows):
            rows.append([]), free.append(row_len)
        rows[r].append(b)
        free[r] -= lengths[b]
    source, target = [], []
    positions = torch.zeros(len(rows), row_len, dtype=torch.long, device=attention_mask.device)
    for r, members in enumerate(rows):
        offset = 0
        for b in members:
            n = int(lengths[b])
            start = int(attention_mask[b].argmax())                           # its first real token
            source.append(torch.arange(n) + b * width + start)
            target.append(torch.arange(n) + r * row_len + offset)
            positions[r, offset:offset + n] = torch.arange(n)
            offset += n
        positions[r, offset:] = torch.arange(row_len - offset)
    source = torch.cat(source).to(input_ids.device)                        # [T]
    target = torch.cat(target).to(input_ids.device)                        # [T]
    ids = torch.zeros(len(rows) * row_len, dtype=input_ids.dtype, device=input_ids.device)
    ids[target] = input_ids.flatten()[source]
    return Packed(ids.view(len(rows), row_len), positions, source, target)


def unpack(values: torch.Tensor, packed: Packed, shape: torch.Size) -> torch.Tensor:
    """Per-token values [rows, row_len, ...] back to the padded layout [batch, len, ...], zeros at padding."""
    flat = values.flatten(0, 1)[packed.target]                              # [T, ...]
    out = flat.new_zeros(shape[0] * shape[1], *flat.shape[1:]).index_copy(0, packed.source, flat)
    return out.view(shape[0], shape[1], *flat.shape[1:])


def packing_works(model) -> bool:
    """Whether `model` keeps packed sequences apart: a model whose attention ignores the position
    jumps would let sequences see each other, silently. Checked once, on three tiny sequences."""
    device = next(model.parameters()).device
    ids = torch.arange(12, device=device).view(3, 4) % model.config.get_text_config().vocab_size
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]], device=device)  # rows 2 and 3 share a packed row
    packed = pack(ids, mask)
    was_training = model.training
    model.eval()  # no dropout in the comparison
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       use_cache=False).logits
        # use_cache=False as in training: transformers looks for packed positions only without a cache
        positions = (vl_inputs(model.config, [{}] * 3, ids, mask, packed)["position_ids"] if is_vl(model.config)
                     else packed.position_ids)  # a VL model finds packed sequences in its text positions
        out = model(input_ids=packed.input_ids, position_ids=positions, use_cache=False).logits
        out = unpack(out, packed, mask.shape)
    model.train(was_training)
    keep = mask.bool()
    return torch.allclose(out[keep].float(), padded[keep].float(), atol=1e-3, rtol=1e-3)


def checked_remove_padding(model, remove_padding: bool) -> bool:
    """use_remove_padding, unless this model cannot pack: then padded, said once (never silently)."""
    if remove_padding and not packing_works(model):
        warnings.warn(f"use_remove_padding: {type(model).__name__} mixes packed sequences; using padded batches")
        return False
    return remove_padding


def seqlen_metrics(attention_mask: torch.Tensor) -> dict[str, float]:
    """Padding waste of a batch: real tokens per sequence and the share of a padded batch they fill."""
    lengths = attention_mask.sum(-1).float()                                # [batch]
    return {"global_seqlen/mean": lengths.mean().item(), "global_seqlen/max": lengths.max().item(),
            "global_seqlen/min": lengths.min().item(), "global_seqlen/real_tokens": lengths.sum().item(),
            "global_seqlen/padded_tokens": float(attention_mask.numel()),
            "global_seqlen/padding_ratio": 1.0 - lengths.sum().item() / attention_mask.numel()}
