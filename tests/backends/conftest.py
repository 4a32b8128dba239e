"""One lean local Ray instance for every Ray test (starting one costs ~5 s on this machine)."""

import os

import pytest

from plait.backends import LEAN_RAY_ENV

os.environ.update(LEAN_RAY_ENV)  # before anything imports ray: loopback only, no usage stats, no auth token


@pytest.fixture(scope="session")
def ray_instance(tmp_path_factory):
    """4 logical CPUs on the 2-core machine: every worker asks for a fraction of one."""
    from plait.backends.ray import start_local_ray, stop_local_ray
    temp = tmp_path_factory.mktemp("ray")
    link_dir = start_local_ray(str(temp), num_cpus=4, object_store_memory_mb=128)
    yield temp
    stop_local_ray(link_dir)
