"""Data parallelism for the training roles (actor, critic): ranks, global sums, shares, gradients.

Every rank gets the whole step batch, walks the same global mini-batches in the same (seeded)
order and trains on its share of each, so N ranks take exactly the optimizer steps one worker
would. Gradients are summed over ranks (one flat all-reduce on CPU; FSDP2 sharding with a summing
reduce-scatter on GPUs), since losses are already normalised by global token counts. Without
torch.distributed every function here is the identity, so the local backend pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.types import RolloutBatch


def dp_rank_size() -> tuple[int, int]:
    """This process's data-parallel rank and world size; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(values: list[float]) -> list[float]:
    """Each value summed over data-parallel ranks, in one collective (identity on one rank)."""
    if dp_rank_size()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def dp_share(rows: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global mini-batch's row indices."""
    rank, world = dp_rank_size()
    return rows.tensor_split(world)[rank]


def check_same_batch(batch: RolloutBatch, who: str) -> None:
    """Each rank takes its share of every global mini-batch, so each must hold the whole batch:
    a pre-split shard (`call_dp`) would silently train on a fraction of the data."""
    if dp_rank_size()[1] == 1:
        return
    sig = torch.tensor([len(batch), batch.responses.sum().item(), batch.response_mask.sum().item()],
                       dtype=torch.float64)
    both = torch.cat([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)   # max == min on every entry iff all ranks agree
    if not torch.equal(both[:3], -both[3:]):
        raise ValueError(f"{who} got different batches on different data-parallel ranks; call it with "
                         "group.call (each rank takes its share of every mini-batch), not group.call_dp")


def all_reduce_grads(model) -> None:
    """Sum gradients over ranks in one flat all-reduce; the losses are normalised by global counts,
    so the sum is the full-batch gradient. A rank with no rows in a mini-batch sends zeros."""
    if dp_rank_size()[1] == 1 or is_sharded(model):  # FSDP2 reduces gradients itself
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def use_fsdp(fsdp: bool | None, device: str) -> bool:
    """FSDP2 by default on CUDA with more than one data-parallel rank; `fsdp` forces it on or off."""
    if fsdp is not None:
        return fsdp
    return device.startswith("cuda") and torch.cuda.is_available() and dp_rank_size()[1] > 1


def shard_model(model, block_names: list[str]) -> None:
    """FSDP2: shard each transformer block (HF `_no_split_modules`) and the root over the DP ranks.

    Gradients are reduced as plain sums, not averages: the losses are already normalised by global
    token counts. (A plain SUM also works on gloo, which lacks NCCL's pre-multiplied sum.)
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    for block in [m for m in model.modules() if type(m).__name__ in block_names]:
        fully_shard(block)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def clip_grads(model, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Unsharded weights (a collective under FSDP2: every rank must call it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def checkpoint_state(model, optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state; under FSDP2 gathered to rank 0 (a collective)."""
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_checkpoint_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
