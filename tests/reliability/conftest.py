"""A small real Trainer for lifecycle tests: a tensor random walk whose state (tensor and RNG) is
checkpointed with torch.save, so a resume that loses or repeats a step changes every later value."""

import contextlib
import json
import os
import time

import pytest
import torch

from plait.profiler import GlobalProfilerConfig
from plait.trainers.lifecycle import Lifecycle, LifecycleConfig, StepResult
from plait.trainers.tracking import Tracker


class WalkTrainer:
    def __init__(self, steps: int, pause: float = 0.0):
        self.steps, self.pause, self.version = steps, pause, 0
        self.gen = torch.Generator().manual_seed(0)
        self.w = torch.zeros(4096)

    def total_steps(self):
        return self.steps

    def start(self):
        pass

    def train_step(self, step, timer):
        with timer.stage("update_actor"):
            time.sleep(self.pause)
            self.w = 0.5 * self.w + torch.randn(4096, generator=self.gen)
        self.version = step
        return StepResult({"w/sum": float(self.w.sum())})

    def validate(self):
        return {"val-core/walk/w": float(self.w.abs().mean())}

    def save_checkpoint(self, path, step):
        os.makedirs(path)
        torch.save(self.w, os.path.join(path, "model.pt"))
        time.sleep(self.pause)  # a wider window for a kill mid-save
        torch.save(self.gen.get_state(), os.path.join(path, "rng.pt"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"version": self.version}, f)

    def load_checkpoint(self, path, step):
        self.w = torch.load(os.path.join(path, "model.pt"))
        self.gen.set_state(torch.load(os.path.join(path, "rng.pt")))
        with open(os.path.join(path, "trainer_state.json")) as f:
            self.version = json.load(f)["version"]

    def profile_targets(self):
        return []

    def held(self):
        return contextlib.nullcontext()

    def close(self):
        pass


def make_lifecycle(out, steps=4, pause=0.0, **cfg):
    cfg = {"save_freq": 1, "test_freq": 2, "max_ckpt_to_keep": 2, **cfg}
    lc = LifecycleConfig(output_dir=str(out), **cfg)
    tracker = Tracker(str(out), [], "p", "e", progress=False)
    return Lifecycle(lc, WalkTrainer(steps, pause), GlobalProfilerConfig(), tracker)


@pytest.fixture
def walk():
    """walk(out_dir, steps=4, pause=0.0, **LifecycleConfig fields) -> a Lifecycle ready to run."""
    return make_lifecycle
