"""`trainer.v1`: verl 0.9.1's V1 trainer keys (its default trainer since verl#6823), as plait runs them.

`trainer_mode` picks plait's mode (`colocate_async`, `separate_async`: plait/trainers/v1_async.py; `sync`:
plait's sync mode), `sampler` the replay buffer's rules (plait/trainers/sampler.py). Torch-free: config.py
imports it before any model loads. Left out: `separate_async.hybrid_rollout` (lending the trainer's devices
to generation), refused when enabled (config_verl.ENABLES says why), its tuning keys named at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from plait.configtree import check
from plait.modes import SYNC, V1_MODES


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: float = 1             # train batches issued before step 1 (fractional: whole gen_batch_size chunks)

    def __post_init__(self):
        check(self.num_warmup_batches >= 0, "num_warmup_batches", self.num_warmup_batches, "must be >= 0")


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: float = 1
    parameter_sync_step: int = 4              # local updates (PPO mini-batches) per weight sync; one step

    def __post_init__(self):
        check(self.num_warmup_batches >= 0, "num_warmup_batches", self.num_warmup_batches, "must be >= 0")
        check(self.parameter_sync_step > 0, "parameter_sync_step", self.parameter_sync_step, "must be > 0")


@dataclass
class CustomSamplerConfig:
    path: Optional[str] = None                # a Python file (or file://FILE)
    name: Optional[str] = None                # its class: verl's sampler signature (docs/modes.md)


@dataclass
class SamplerConfig:
    max_off_policy_threshold: Optional[int] = 8   # versions from issue to training; null: no control
    max_off_policy_strategy: Literal["drop", "wait"] = "drop"
    sync_refill_failed_groups: bool = False   # verl's sync sampler only (plait's sync mode: see docs/modes.md)
    custom_sampler: CustomSamplerConfig = field(default_factory=CustomSamplerConfig)
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)  # handed to a custom sampler

    def __post_init__(self):
        t = self.max_off_policy_threshold
        check(t is None or t > 0, "max_off_policy_threshold", t, "an integer > 0, or null to turn version control off")
        c = self.custom_sampler
        missing = "path" if c.name and not c.path else "name"  # the error names the key that is missing
        check(bool(c.path) == bool(c.name), f"custom_sampler.{missing}", getattr(c, missing),
              f"set with custom_sampler.{'name' if missing == 'path' else 'path'}: both path and name, or neither")


@dataclass
class V1Config:
    trainer_mode: Literal[(SYNC, *V1_MODES)] = SYNC
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
