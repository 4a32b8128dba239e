"""Ranks side by side on the Ray backend: every training rank records its stage spans every step (no
profiler needed), metrics.jsonl carries each rank's time per stage, the skew and the slowest rank, and a
planted straggler (rank 1 sleeps in its update: tests/backends/slow_workers.py, a test-only subclass) is
named by rank in the report and the verdict. The same run profiles step 2 on both ranks and its merged
window trace keeps every source's nesting and flow ids apart.
"""

import json
import os
from collections import defaultdict

import pytest

pytest.importorskip("ray")

from plait import cli, driver
from plait.config import load_config
from plait.profiler.analysis.traces import nesting_violations, read_merged
from tests.backends.slow_workers import SlowRank1Actor, torch_log_env
from tests.backends.test_ray import TINY

pytestmark = pytest.mark.ray
STEPS = 3


@pytest.fixture(scope="module")
def straggler_run(ray_instance, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "run"
    patch = pytest.MonkeyPatch()
    patch.setattr("plait.build.Actor", SlowRank1Actor)
    try:
        cfg = load_config(None, [*TINY, f"trainer.default_local_dir={out}", f"trainer.total_training_steps={STEPS}",
                                 "global_profiler.tool=torch", "global_profiler.steps=[2]",
                                 "actor_rollout_ref.actor.profiler.enable=true",
                                 "actor_rollout_ref.actor.profiler.all_ranks=true"])
        lifecycle = driver.build(cfg, progress=False)
        (out / "worker_env.json").write_text(json.dumps(lifecycle.trainer.roles.actor.call(torch_log_env)))
        lifecycle.run()
    finally:
        patch.undo()
    return out


def lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def test_every_rank_records_its_stages_every_step(straggler_run):
    spans = lines(straggler_run / "timeline.jsonl")
    ranks = defaultdict(set)
    for s in spans:
        if s.get("rank") is not None and s["role"] == "actor" and s["stage"] == "update_actor":
            ranks[s["step"]].add(s["rank"])
    assert dict(ranks) == {step: {0, 1} for step in range(1, STEPS + 1)}  # outside the window too
    # update_weights (the actor's state dict for the rollout) is every rank's work too (issue 52: missing)
    weights = {(s["step"], s["rank"]) for s in spans if s.get("rank") is not None and s["role"] == "actor"
               and s["stage"] == "update_weights"}
    assert weights == {(step, rank) for step in range(1, STEPS + 1) for rank in (0, 1)}
    assert any(s.get("rank") == 0 and s["stage"] == "all_reduce" for s in spans)  # the waits are spans too
    worker_pids = {s["pid"] for s in spans if s.get("rank") is not None}
    assert len(worker_pids) == 2 and os.getpid() not in worker_pids


def test_metrics_name_the_slow_rank_and_its_skew(straggler_run):
    for r in lines(straggler_run / "metrics.jsonl"):
        if r["step"] < 1:
            continue
        assert r["ranks/actor/update_actor/slowest_rank"] == 1
        assert r["ranks/actor/update_actor/skew"] >= 1.5
        # rank 0 waits for rank 1 in the update's collectives; rank 1 hardly waits
        assert r["ranks/actor/update_actor/rank0_wait_s"] > r["ranks/actor/update_actor/rank1_wait_s"] + 0.2


def test_the_verdict_and_the_report_name_the_straggler(straggler_run, capsys):
    summary = json.load(open(straggler_run / "summary.json"))
    first = summary["verdict"][0]
    assert (first["rule"], first["where"]) == ("straggler", "actor rank 1 in update_actor"), first["line"]
    assert "the other ranks wait" in first["line"] and first["key"] == ""
    capsys.readouterr()
    assert cli.main(["profile", "report", str(straggler_run)]) == 0
    out = capsys.readouterr()
    verdict = next(line for line in out.out.splitlines() if line.startswith("verdict: "))  # after any alarm
    assert verdict.startswith("verdict: actor rank 1 in update_actor is ") and "slowest rank 1" in out.out
    page = (straggler_run / "report" / "index.html").read_text()
    assert "Ranks side by side" in page and "actor/update_actor: slowest rank 1" in page
    assert "actor rank 1 (" in page  # its own lane in the Gantt


def test_workers_start_with_kinetos_and_torchs_log_lines_silenced(straggler_run):
    """Set in the Ray workers' environment before they import torch ("External init callback" is printed then)."""
    env = json.loads((straggler_run / "worker_env.json").read_text())
    assert env == {"KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "6"),
                   "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}


def test_profiled_workers_print_no_kineto_init_error(straggler_run, ray_instance):
    """issue 52: Kineto's "ERROR: External init callback must run in same thread as registerClient" (a plain
    fprintf, no log level silences it) came from every profiled worker: Kineto started on the thread of the
    window's call, not the one that loaded torch. Ray keeps each worker's stderr in its session's logs."""
    logs = [p for p in ray_instance.rglob("worker-*.err")]
    assert logs  # the workers' stderr is where this looks
    printed = [p.name for p in logs if "External init callback" in p.read_text(errors="replace")]
    assert printed == []


def test_the_two_rank_window_keeps_nesting_and_flows_per_source(straggler_run):
    events = read_merged(str(straggler_run / "report" / "step2.trace.json.gz"))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"actor rank 0", "actor rank 1"} <= set(procs.values())
    assert nesting_violations(events) == 0
    sources = defaultdict(set)  # flow id -> the processes (ranks) its arrows touch
    for e in events:
        if e.get("ph") in ("s", "t", "f"):
            sources[e["id"]].add(procs[e["pid"]].split(" (")[0])
    assert sources and all(len(s) == 1 for s in sources.values())
    assert len({next(iter(s)) for s in sources.values()}) == 2  # both ranks' flows, none shared
