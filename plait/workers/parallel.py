"""Data parallelism for the training roles (actor, critic, ref, reward model): ranks, global sums,
shares, gradients, sharding and sharded checkpoints.

Every rank gets the whole step batch, walks the same global mini-batches in the same (seeded)
order and trains on its share of each, so N ranks take exactly the optimizer steps one worker
would. Forward-only passes (log-probs, ref log-probs, values, scores) run each rank's share of the
rows and gather the results once (`data_parallel`), so every rank returns the whole batch's.
Gradients are summed over ranks: one flat all-reduce for plain replicas, a summing reduce-scatter
under FSDP2 (`strategy`: fsdp2 shards on any device, fsdp on CUDA only), since losses are
already normalised by global token counts. FSDP2's forward is a collective, so under it every
rank runs as many micro-batches as the busiest one (`even_micro_batches`). Sharded checkpoints
are torch.distributed.checkpoint folders: each rank writes its shards, and a load at any world
size (one unsharded worker included) reads the slices it needs. Without torch.distributed every
function here is the identity, so the local backend pays nothing.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from plait.config import FsdpConfig
from plait.profiler.timeline import RANK_SPANS
from plait.safeload import check_dcp_metadata, loads_tensors
from plait.types import RolloutBatch
from plait.workers.packing import MicroBatching


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
    with RANK_SPANS.collective("all_reduce"):  # a rank's wait for the slowest one: its span (Ray workers)
        dist.all_reduce(t)
    return t.tolist()


def global_maxima(values: list[float]) -> list[float]:
    """Each value's maximum over data-parallel ranks, in one collective (identity on one rank)."""
    if dp_rank_size()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    with RANK_SPANS.collective("all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
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
    with RANK_SPANS.collective("all_reduce"):
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
    with RANK_SPANS.collective("all_reduce"):
        dist.all_reduce(flat)
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def global_max(value: int) -> int:
    if dp_rank_size()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    with RANK_SPANS.collective("all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_extremes(values: dict[str, float]) -> dict[str, float]:
    """Each value's minimum (a name ending _min) or maximum (any other) over data-parallel ranks, in one
    collective (identity on one rank); every rank passes the same names."""
    if dp_rank_size()[1] == 1:
        return values
    signs = [-1.0 if k.endswith("_min") else 1.0 for k in values]  # a minimum: the maximum of the negatives
    t = torch.tensor([s * v for s, v in zip(signs, values.values())], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: s * v for k, s, v in zip(values, signs, t.tolist())}


def data_parallel(batch: RolloutBatch, forward: Callable[[RolloutBatch], tuple], who: str) -> tuple:
    """`forward` (tensors [rows, ...] out) on this rank's share of the batch's rows; every rank's
    results gathered in one collective, so each rank returns the whole batch's [batch, ...] on CPU."""
    rank, world = dp_rank_size()
    if world == 1 or len(batch) < world:  # fewer rows than ranks: each computes them all
        return tuple(t.cpu() for t in forward(batch))
    check_same_batch(batch, who)
    sizes = [len(r) for r in torch.arange(len(batch)).tensor_split(world)]
    mine = [t.detach().float().cpu() for t in forward(batch.select(dp_share(torch.arange(len(batch)))))]
    shape = mine[0].shape[1:]
    # One buffer per rank: every output side by side, padded to the largest share (all_gather needs one size).
    flat = torch.zeros(sizes[0], len(mine), *shape)                          # [max_share, outputs, ...]
    flat[:sizes[rank]] = torch.stack(mine, dim=1)
    parts = [torch.empty_like(flat) for _ in range(world)]
    with RANK_SPANS.collective("all_gather"):
        dist.all_gather(parts, flat)
    whole = torch.cat([p[:n] for p, n in zip(parts, sizes)])               # [batch, outputs, ...]
    return tuple(whole[:, i] for i in range(len(mine)))


def even_micro_batches(splits: list[list[int]], model) -> list[tuple[list[int], bool]]:
    """(rows, is_padding) per micro-batch. Under FSDP2 each forward all-gathers every block's shards
    from all ranks, so a rank with fewer micro-batches (an uneven share, token-budget bins) repeats
    its last one, flagged as padding (its result is discarded, its loss weighted 0)."""
    out = [(rows, False) for rows in splits]
    if not is_sharded(model):
        return out
    count = global_max(len(splits))
    if count > len(splits) and not splits:
        raise ValueError("a data-parallel rank got no rows under FSDP2: give each mini-batch at least one row per rank")
    return out + [(splits[-1], True)] * (count - len(splits))


class EvenMicroBatching(MicroBatching):
    """A forward-only layout with `even_micro_batches`' count on every rank (a repeated micro-batch
    writes the same values twice)."""

    def __init__(self, layout: MicroBatching, model):
        super().__init__(**asdict(layout))
        self.model = model

    def split(self, batch: RolloutBatch) -> list[list[int]]:
        return [rows for rows, _ in even_micro_batches(super().split(batch), self.model)]


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def use_fsdp(strategy: str, device: str) -> bool:
    """Shard with FSDP2 as `strategy` (verl's key) asks: fsdp2 whenever torch.distributed runs (gloo on
    CPU, NCCL on CUDA; one rank too, as verl wraps one GPU); fsdp (verl's default, FSDP1 there) on CUDA
    with more than one rank, so that CPU ranks stay whole replicas with one flat gradient all-reduce,
    the faster path there. The local backend (no torch.distributed) never shards."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return strategy == "fsdp2" or (device.startswith("cuda") and dp_rank_size()[1] > 1)


def shard_model(model, block_names: list[str], cfg: FsdpConfig, device: str, compute: torch.dtype | None = None) -> None:
    """FSDP2: shard each transformer block (HF `_no_split_modules`) and the root over the DP ranks,
    computing in `compute` (null: fsdp_config.mixed_precision.param_dtype) and reducing gradients in
    mixed_precision.reduce_dtype (null: float32, verl's default).

    Gradients are reduced as plain sums, not averages: the losses are already normalised by global
    token counts. (A plain SUM also works on gloo, which lacks NCCL's pre-multiplied sum.)
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from plait.config import MP_DTYPES
    # FSDP2's offload: parameters, and with them gradients and the optimizer step and state, live on CPU.
    # optimizer_offload alone keeps the parameters on the GPU (optimizer_step).
    offload = device.startswith("cuda") and (cfg.param_offload or cfg.offload_policy)
    mp = cfg.mixed_precision
    dtype = lambda name: None if name is None else getattr(torch, MP_DTYPES[name])  # noqa: E731
    kw = dict(reshard_after_forward=cfg.reshard_after_forward,
              offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
              mp_policy=MixedPrecisionPolicy(param_dtype=compute or dtype(mp.param_dtype),
                                             reduce_dtype=dtype(mp.reduce_dtype) or torch.float32))
    blocks = [m for m in model.modules() if type(m).__name__ in block_names
              and sum(p.numel() for p in m.parameters()) >= cfg.wrap_policy.min_num_params]
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if not cfg.reshard_after_forward:
        # torch 2.13 (gloo, 2 ranks): a group that a no-grad forward leaves unsharded gets wrong gradients
        # from the next training forward and backward (log-probs stay right), the root's and each block's
        # alike. A no-grad pass has no backward to keep the weights for: reshard after it.
        for m in [*blocks, model]:
            m.register_forward_hook(_reshard_without_grad)
    if cfg.forward_prefetch:  # all-gather the next block's weights while this one computes
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _reshard_without_grad(module, args, output) -> None:
    if not torch.is_grad_enabled():
        module.reshard()


def offloads_optimizer(cfg: FsdpConfig, device: str) -> bool:
    """fsdp_config.optimizer_offload on CUDA without the parameter offload (which holds the state on CPU anyway)."""
    return device.startswith("cuda") and cfg.optimizer_offload and not (cfg.param_offload or cfg.offload_policy)


def optimizer_step(optimizer, offload: bool) -> None:
    """optimizer.step(); with `offload` (offloads_optimizer) the state, Adam's moments, is on the GPU only
    for the step and waits in CPU memory through the forwards and backwards."""
    if offload:
        _move_state(optimizer, "cuda")
    optimizer.step()
    if offload:
        _move_state(optimizer, "cpu")


def _move_state(optimizer, device: str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):  # the step count stays where AdamW keeps it
                state[key] = value.to(device, non_blocking=device == "cpu")
    if device == "cpu":
        torch.cuda.synchronize()  # the copies are done before the GPU memory is reused


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


SHARDED_DIR = "sharded"  # a role's torch.distributed.checkpoint folder inside its checkpoint


def save_sharded(path: str, model, optimizer) -> None:
    """Every rank writes its own shards of the model and optimizer state; nothing is gathered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    with rank_failure():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_sharded(path: str, model, optimizer) -> None:
    """Read a `save_sharded` folder into this model, sharded or whole, at any world size: each rank
    reads the slices its own shards cover (parameter names, not ranks, key the files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    check_dcp_metadata(path)  # torch unpickles .metadata without restriction: vet it first
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to fill (optimizer state initialised)
    state = {"model": model_state, "optim": optim_state}
    with rank_failure():
        dcp.load(state, checkpoint_id=path, planner=_TensorsOnlyPlanner(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a shard's byte items (pickled non-tensor state) load with
    torch's weights_only loader: its default unpickles them unrestricted, so a crafted shard ran code."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item, value) -> None:
        shard = self.metadata.storage_data[read_item.storage_index].relative_path
        loaded = loads_tensors(value, f"{os.path.join(self.folder, shard)} (item {read_item.dest_index.fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@contextmanager
def rank_failure():
    """DCP wraps any rank's failure in a CheckpointException (a BaseException whose text is every
    rank's traceback): re-raise the first rank's own error, so a full disk or a refused file reads
    as the one line it is."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as err:
        rank = min(err.failures)
        raise err.failures[rank][0] from None


def load_checkpoint_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
