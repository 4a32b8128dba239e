"""Trainer modes. Each supplies only what differs; all run plait/trainers/lifecycle.py."""

from plait.trainers.fully_async import FullyAsyncTrainer
from plait.trainers.one_step_off import OneStepOffTrainer
from plait.trainers.sync import SyncTrainer

MODES = {"sync": SyncTrainer, "one_step_off": OneStepOffTrainer, "fully_async": FullyAsyncTrainer}
