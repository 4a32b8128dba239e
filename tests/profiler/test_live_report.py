"""The live report: report/index.html refreshed while the run trains, from inside the run
(`global_profiler.report_freq`, a low-priority child process) and from outside (`plait profile report
--watch DIR`), the verdict included; the last refresh reads the run's summary."""

import json
import os
import subprocess
import sys
import time

from plait import cli, driver
from plait.profiler.analysis import report
from plait.configtree import ConfigError
from tests.conftest import TINY

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=4"]


def test_the_run_refreshes_its_report_every_n_steps(tmp_path, tiny_config):
    lifecycle = driver.build(tiny_config(tmp_path, *QUIET, "global_profiler.report_freq=2"), progress=False)
    lifecycle.run()
    live = lifecycle.live
    assert live.started >= 2 and live.started + live.skipped == 3  # steps 2 and 4, then the last one after the summary
    page = (tmp_path / "report" / "index.html").read_text()
    judged = json.load(open(tmp_path / "report" / "verdict.json"))
    assert "id='verdict'" in page and "wall time</td>" in page  # the last refresh read summary.json
    assert judged["facts"]["steps"] == 3  # steps 2-4: the verdict leaves out step 1, the warm-up
    assert not any(n.endswith(".json.gz") for n in os.listdir(tmp_path / "report"))  # live: no merged traces
    assert "Traceback" not in (tmp_path / "report_live.log").read_text()


def test_report_freq_is_checked():
    import pytest
    with pytest.raises(ConfigError, match="report_freq"):
        from plait.config import load_config
        load_config(None, [*TINY, "global_profiler.report_freq=-1"])


# step 2's rewards wait for the watch's first report, so that the watch sees the run both training and ended
GATED = '''
import os, time
calls = 0
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    if calls == 17:  # step 2's first of 4 x 4 responses
        gate, deadline = os.environ["GATE"], time.time() + 240
        while not os.path.exists(gate) and time.time() < deadline:
            time.sleep(0.05)
    return float(len(solution_str) % 2)
'''


def test_watch_follows_a_run_from_outside_until_it_ends(tmp_path, capsys):
    reward, out = tmp_path / "gated.py", tmp_path / "run"
    reward.write_text(GATED)
    run = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY, *QUIET,
                            "trainer.total_training_steps=6", f"trainer.default_local_dir={out}",
                            f"custom_reward_function.path={reward}", "reward.num_workers=0"],
                           env={**os.environ, "GATE": str(out / "report" / "index.html")},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert cli.main(["profile", "report", str(out), "--watch", "--interval", "0.3"]) == 0
    finally:
        run.wait(300)
    assert run.returncode == 0
    refreshes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plait: report refreshed")]
    assert len(refreshes) >= 2  # while it trained, and after it ended
    assert json.load(open(out / "report" / "verdict.json"))["facts"]["steps"] == 5  # 2-6: 1 warms up
    assert "wall time</td>" in (out / "report" / "index.html").read_text()


def test_watching_a_run_that_has_ended_refreshes_once_and_returns(tmp_path, tiny_config, capsys):
    driver.run(tiny_config(tmp_path, *QUIET), progress=False)
    assert cli.main(["profile", "report", str(tmp_path), "--watch", "--interval", "0.05"]) == 0
    assert len([line for line in capsys.readouterr().err.splitlines() if "report refreshed" in line]) == 1
    assert "wall time</td>" in (tmp_path / "report" / "index.html").read_text()
    os.utime(tmp_path / ".plait.lock")  # as a resumed run does: its old summary is no longer the end
    assert not report.run_ended(str(tmp_path))
