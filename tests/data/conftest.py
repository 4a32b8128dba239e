import pytest
import torch

from plait.models import create_tiny_model

torch.set_num_threads(1)  # the machine's cores are shared; more threads only slow these tests


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "xs", size="xs", seed=0)
