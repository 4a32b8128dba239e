"""`plait profile diff A B` in the "profile, fix, rerun" flow: A profiled on two steps (so its profiler line
predicts the cost of one window), B a rerun without the profiler. It printed a TypeError (B measured 0 s
of profiling: no ratio was computed, then formatted) and listed every operator of A as "removed"."""

import json

from plait import cli, driver
from plait.config import load_config
from tests.conftest import TINY

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.total_training_steps=3"]
PROFILED = ["global_profiler.tool=torch", "global_profiler.steps=[1,2]", "actor_rollout_ref.actor.profiler.enable=true"]


def test_a_profiled_run_against_an_unprofiled_rerun(tmp_path, capsys):
    for name, extra in (("a", PROFILED), ("b", [])):
        cfg = load_config(None, [*TINY, *QUIET, f"trainer.default_local_dir={tmp_path / name}", *extra])
        driver.build(cfg, progress=False).run()
    capsys.readouterr()
    assert cli.main(["profile", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "operators: B has no torch traces (global_profiler.tool=torch): operators not compared" in out
    assert "removed" not in out
    row = next(line for line in out.splitlines() if line.startswith("A's verdict (profiler_share): spent_s"))
    assert "B measured 0 s" in row
    assert cli.main(["profile", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["operators"] == {} and len(got["operators_not_compared"]) == 1
