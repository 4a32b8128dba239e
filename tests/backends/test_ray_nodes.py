"""A 2-node Ray cluster on one machine: two `ray start` processes on loopback addresses (127.0.0.3
the head, 127.0.0.2 the second node), each with its own custom resource; `plait train` joins it and
the pools (train, the rollout's own, the reward model's own) land where `trainer.ray.pool_resources`
says, each role saying where in one line."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("ray")

from test_ray import TINY  # noqa: E402

pytestmark = pytest.mark.ray


# The tests' lean single-machine Ray mode (conftest.py) is for Ray instances plait starts; a
# cluster of several nodes is started and joined without it.
CLUSTER_ENV = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_nodes(resources: dict[str, str]):
    """A `ray start --block` process per node, the first the head, each on its loopback address with its custom
    resources: (the head's address, {ip: process}). Each stops its own Ray processes on SIGTERM (never `ray stop`,
    which would stop every Ray on the machine)."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="plait-nodes-")  # short: Ray's socket paths are limited
    head = next(iter(resources))
    common = ["--block", "--num-cpus=2", "--disable-usage-stats", "--object-store-memory=200000000"]
    procs = {}
    try:
        for ip, resource in resources.items():
            role = ["--head", f"--port={port}", "--include-dashboard=false"] if ip == head else [f"--address={head}:{port}"]
            with open(os.path.join(temp, f"{ip}.log"), "w") as log:
                # A temp dir per node: two raylets of one machine must not share socket paths.
                procs[ip] = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", *role,
                                              f"--node-ip-address={ip}", f'--resources={{"{resource}": 4}}', *common,
                                              f"--temp-dir={temp}/{ip}"],
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=CLUSTER_ENV)
        yield f"{head}:{port}", procs
    finally:
        for p in reversed(list(procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def two_nodes():
    with ray_nodes({"127.0.0.3": "train_node", "127.0.0.2": "gen_node"}) as (address, _):
        yield address


def test_roles_land_on_the_nodes_the_config_names(two_nodes, tmp_path):
    """Three pools: train (actor, FSDP2 over 2 ranks) on the head; the rollout's own pool (verl's
    rollout.nnodes=1 x n_gpus_per_node=2: one process holding 2 CPU slots) and the reward model's
    (reward.reward_model.enable_resource_pool, 1 x 2: two ranks, sharded among themselves) on the second node."""
    from test_fsdp import reward_model_dir
    rm = reward_model_dir(tmp_path / "rm")
    # The second node may still be joining: the rollout pool waits for its resource (placement_timeout_s).
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.total_training_steps=1", "trainer.placement=separated", f"trainer.ray.address={two_nodes}",
           "trainer.ray.pool_resources={train: {train_node: 1}, rollout: {gen_node: 1}, reward: {gen_node: 1}}",
           "trainer.ray.placement_timeout_s=120", "actor_rollout_ref.actor.strategy=fsdp2",
           "rollout.nnodes=1", "rollout.n_gpus_per_node=2",  # the fully-async recipe's spelling
           "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm}",
           "reward.reward_model.enable_resource_pool=true", "reward.reward_model.nnodes=1",
           "reward.reward_model.n_gpus_per_node=2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**CLUSTER_ENV, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = re.findall(r"plait: (\w+) runs on (127\.0\.0\.\d) \(node (\w+)\): (.*)", run.stderr)
    where = {role: ip for role, ip, _, _ in lines}
    assert where == {"actor": "127.0.0.3", "rollout": "127.0.0.2", "reward_model": "127.0.0.2"}, run.stderr[-3000:]
    node = {role: node_id for role, _, node_id, _ in lines}
    assert node["actor"] != node["rollout"] == node["reward_model"]
    what = {role: rest for role, _, _, rest in lines}
    assert what["actor"] == "ranks 0,1, 2 CPU process(es), 1 CPUs"
    assert what["rollout"] == "rank 0, 1 CPU process(es), 1 CPUs"  # 2 slots of cpus_per_worker=0.5
    assert what["reward_model"] == "ranks 0,1, 2 CPU process(es), 1 CPUs"
    assert os.path.isfile(tmp_path / "run" / "metrics.jsonl")


@pytest.fixture
def three_nodes():
    """A head for the train pool and two nodes that can each hold the rollout."""
    with ray_nodes({"127.0.0.3": "train_node", "127.0.0.2": "gen_node", "127.0.0.4": "gen_node"}) as nodes:
        yield nodes


def test_a_node_lost_mid_run_is_one_line_and_the_run_goes_on_on_the_nodes_left(three_nodes, tmp_path):
    """The node holding the rollout is killed whole (its raylet and workers, as a machine that goes away) after
    step 1: the run says so in one line naming the rollout, and finishes every step with the rollout on the other node."""
    address, procs = three_nodes
    cmd = [sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY, f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.max_restarts=1",
           "trainer.placement=separated", f"trainer.ray.address={address}", "trainer.ray.placement_timeout_s=120",
           "trainer.ray.pool_resources={train: {train_node: 1}, rollout: {gen_node: 1}}", "trainer.logger=[console,file]"]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**CLUSTER_ENV, "OMP_NUM_THREADS": "1"})
    lines, lost = [], None
    try:
        for line in run.stdout:
            lines.append(line)
            found = re.match(r"plait: rollout runs on (127\.0\.0\.\d)", line)
            if found and lost is None:
                lost = found.group(1)
            if line.startswith("step 1 ") and lost in procs:
                os.killpg(procs[lost].pid, signal.SIGKILL)  # the node goes away: raylet, object store, workers
        run.wait(600)
    finally:
        if run.poll() is None:
            run.kill()
    out = "".join(lines)
    assert run.returncode == 0, out[-4000:]
    assert lost in ("127.0.0.2", "127.0.0.4")
    placed = re.findall(r"plait: rollout runs on (127\.0\.0\.\d)", out)
    assert placed[0] == lost and placed[-1] != lost, out[-4000:]
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert sorted(set(steps)) == [1, 2, 3, 4], out[-4000:]
    assert "Traceback" not in out and "plait: warning: the rollout engine died in step 2" in out
    assert "plait: restart 1 of 1 (trainer.max_restarts) after: rollout worker rank 0 died" in out  # its node is gone
