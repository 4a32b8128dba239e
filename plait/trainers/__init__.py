"""Trainer modes. Each supplies only what differs; all run plait/trainers/lifecycle.py."""

from plait.trainers.sync import SyncTrainer

MODES = {"sync": SyncTrainer}
