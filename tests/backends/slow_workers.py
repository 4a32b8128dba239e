"""Test-only workers with a planted fault, importable by Ray's worker processes by name (a class in a
pytest module is not: pytest imports test modules under names the workers cannot import)."""

import time

from plait.workers.actor import Actor
from plait.workers.parallel import dp_rank_size

PLANTED_S = 0.4  # seconds data-parallel rank 1 sleeps in each update, before its first collective


class SlowRank1Actor(Actor):
    """The actor, except that rank 1 sleeps PLANTED_S inside update_actor: a straggler the others wait for."""

    def _update(self, batch, correction):
        if dp_rank_size()[0] == 1:
            time.sleep(PLANTED_S)
        return super()._update(batch, correction)


def torch_log_env(worker) -> dict:
    """What a worker process was started with (called on it by reference): the variables that silence
    Kineto's and PyTorch's C++ log lines, read when the process imports torch."""
    import os
    return {k: os.environ.get(k) for k in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
