"""Hostile reward functions: NaN/inf scores, sys.exit, KeyboardInterrupt and a hang are errors
naming the function, the data_source and the sample; never a silent skip or a clean exit."""

import math
import sys
import threading

import pytest

from plait import cli
from plait.data.rewards import ScoreRequest, guard_reward, naive_manager
from plait.errors import Interrupted, RunError


def nan_on_second(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan if solution_str == "b" else 1.0


def inf_in_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": math.inf, "acc": 1.0}


def exits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(0)


def interrupts(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyboardInterrupt


RELEASE = threading.Event()


def hangs(data_source, solution_str, ground_truth, extra_info=None):
    RELEASE.wait(30)


def score(fn, name, timeout=None):
    request = ScoreRequest(["mine", "mine"], ["a", "b"], ["1", "2"], [None, None], [1, 1])
    return naive_manager(guard_reward(fn, name, timeout), request)


@pytest.mark.parametrize("fn, said", [(nan_on_second, "returned nan"), (inf_in_dict, "returned inf"),
                                      (exits, "raised SystemExit"), (interrupts, "raised KeyboardInterrupt")])
def test_hostile_results_are_errors_naming_function_data_source_and_sample(fn, said):
    with pytest.raises(RunError, match=said) as err:
        score(fn, fn.__name__)
    assert f"reward function {fn.__name__} (data_source 'mine', response " in str(err.value)


def test_a_hanging_call_times_out_with_a_named_error():
    with pytest.raises(RunError, match=r"hangs \(data_source 'mine', response 'a'\) did not return within "
                                       r"reward.custom_reward_function.timeout=0.2 s"):
        score(hangs, "hangs", timeout=0.2)
    RELEASE.set()  # the abandoned call ends, so no thread outlives the test
    for thread in threading.enumerate():
        if thread.name == "plait-reward":
            thread.join()


def test_a_real_signal_during_a_call_still_interrupts():
    def signalled(**kwargs):
        raise Interrupted(15)
    with pytest.raises(Interrupted):
        score(signalled, "signalled")


def test_a_well_behaved_function_scores_as_before_with_a_timeout():
    assert score(lambda data_source, solution_str, ground_truth, extra_info=None: float(solution_str == "a"), "ok", timeout=5) == ([1.0, 0.0], {})


def test_nan_reward_in_a_run_exits_1_with_one_line_and_saves_no_checkpoint(tmp_path, tiny_config, capsys):
    (tmp_path / "reward.py").write_text("def bad(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float('nan')\n")
    cfg_args = [f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=bad",
                "trainer.save_freq=1"]
    import yaml
    from plait.configtree import to_dict
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(tiny_config(tmp_path / "out", *cfg_args))))
    assert cli.main(["train", "--no-progress", "--config", str(config)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("plait: error: reward function bad (data_source 'arithmetic', response ")
    assert last.endswith("returned nan; rewards must be finite numbers")
    assert not (tmp_path / "out" / "checkpoints").exists()
