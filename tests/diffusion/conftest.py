"""Shared fixtures for the diffusion tests: a profiler handle and one quickly pre-trained model."""

import contextlib

import pytest
import torch

from plait.workers.diffusion import DiffusionModelConfig, load_flow_model, pretrain_flow_model

torch.set_num_threads(1)

# 50 steps: recognisable but imperfect glyphs (held-out classifier reward ~0.74), about 1.5 s.
_PRETRAIN = dict(cfg=DiffusionModelConfig(width=128, depth=2), steps=50, batch_size=128, lr=2e-3, seed=0)


class RecordingProfiler:
    """The worker-facing profiler handle: annotate(stage) and mini_batch(i) are context managers; stages
    are recorded."""

    def __init__(self):
        self.stages = []

    def annotate(self, stage, scheduled=False):
        self.stages.append(stage)
        return contextlib.nullcontext()

    def mini_batch(self, index):
        return contextlib.nullcontext()


@pytest.fixture
def profiler():
    return RecordingProfiler()


@pytest.fixture(scope="session")
def pretrain_settings():
    return dict(_PRETRAIN)


@pytest.fixture(scope="session")
def pretrained_dir(tmp_path_factory, pretrain_settings):
    return pretrain_flow_model(out_dir=tmp_path_factory.mktemp("flow"), **pretrain_settings)


@pytest.fixture
def model(pretrained_dir):
    return load_flow_model(pretrained_dir)
