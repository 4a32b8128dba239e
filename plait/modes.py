"""The trainer modes, one row each: the facts the rest of plait asks about a mode, in one place.

config checks a mode's keys and placement against its row, build picks its trainer (build.py's TRAINERS),
the driver asks whether a rollout thread runs beside the trainer, and the verdict which idle metrics it logs
and which rules apply: nobody keeps a list of mode names of its own. A new mode is one row here and one
trainer. Torch-free: config.py imports it before any torch. The names are verl's (`trainer.mode` values,
and `trainer.v1.trainer_mode` for its V1 trainer's two modes); as literals they appear here and in the
config's own key only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SYNC, ONE_STEP_OFF, FULLY_ASYNC = "sync", "one_step_off", "fully_async"
COLOCATE_ASYNC, SEPARATE_ASYNC = "colocate_async", "separate_async"   # verl 0.9.1's V1 trainer
DIFFUSION = "diffusion"


@dataclass(frozen=True)
class Mode:
    lm: bool = True                  # trains a language model (False: the diffusion trainer, Flow-GRPO)
    rollout_thread: bool = False     # on the local backend its rollout generates in a thread of the driver, beside
    #   the trainer (one process: per-stage traces and CPU memory snapshots cannot tell the two apart)
    placement: Optional[str] = None  # the trainer.placement it needs (None: either)
    idle_pair: bool = False          # logs trainer/idle_ratio and rollouter/idle_ratio as an overlap of the two sides
    async_keys: bool = False         # reads async_training.* (verl's one_step_off / fully_async recipes)
    v1: bool = False                 # verl 0.9.1's V1 trainer (trainer.v1.*), picked by trainer.v1.trainer_mode
    streams: bool = False            # a streaming rollouter: a step is trigger_parameter_sync_step local updates,
    #   staleness-bounded samples, partial rollout


MODES: dict[str, Mode] = {
    SYNC: Mode(),
    ONE_STEP_OFF: Mode(rollout_thread=True, placement="separated", idle_pair=True, async_keys=True),
    FULLY_ASYNC: Mode(rollout_thread=True, placement="separated", idle_pair=True, async_keys=True, streams=True),
    COLOCATE_ASYNC: Mode(rollout_thread=True, v1=True),  # its rollouter pauses while the trainer trains: no overlap
    SEPARATE_ASYNC: Mode(rollout_thread=True, placement="separated", idle_pair=True, v1=True),
    DIFFUSION: Mode(lm=False),
}

ASYNC_MODES = tuple(name for name, m in MODES.items() if m.async_keys)  # where async_training.* applies
V1_MODES = tuple(name for name, m in MODES.items() if m.v1)
