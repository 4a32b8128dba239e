import math

import pytest

from plait.data.rewards import (default_compute_score, exact_match_score, load_custom_reward,
                                score_batch)
from plait.data.tasks import TASKS, make_task_rows


@pytest.mark.parametrize("response, expected", [
    ("19", 1.0), (" 19\nfoo", 1.0), ("19<eos>", 1.0), ("19=19", 1.0),
    ("190", 0.0), ("1 9", 0.0), ("18", 0.0), ("", 0.0), ("x19", 0.0), ("+19", 0.0),
])
def test_arithmetic_scores(response, expected):
    assert default_compute_score("arithmetic", response, "19") == expected


@pytest.mark.parametrize("response, expected", [
    ("cba", 1.0), ("\ncba\nabc", 1.0), ("cba.", 1.0),
    ("cbax", 0.0), ("cb", 0.0), ("CBA", 0.0), ("c ba", 0.0),
])
def test_reverse_scores(response, expected):
    assert default_compute_score("reverse", response, "cba", extra_info={"index": 0}) == expected


def test_format_score_and_negative_answers():
    assert exact_match_score("arithmetic", "18", "19", format_score=0.1) == 0.1
    assert exact_match_score("arithmetic", "no", "19", format_score=0.1) == 0.0
    assert exact_match_score("arithmetic", "-3", "-3") == 1.0


@pytest.mark.parametrize("task", list(TASKS))
def test_every_ground_truth_scores_one(task):
    for row in make_task_rows(task, "test", 20, seed=0):
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(task, truth, truth, row["extra_info"]) == 1.0


def test_unknown_data_source_says_what_to_do():
    with pytest.raises(ValueError, match="'gsm8k'.*arithmetic, reverse.*custom_reward_function"):
        default_compute_score("gsm8k", "42", "42")


def test_custom_reward_loads_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    hit = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': 2 * hit, 'hit': hit, 'pred': solution_str}\n"
        "def _helper():\n    pass\n")
    fn = load_custom_reward(str(path), "compute_score")
    assert fn("x", " a ", "a") == {"score": 2.0, "hit": 1.0, "pred": " a "}
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path.*nope.py"):
        load_custom_reward(str(tmp_path / "nope.py"), "compute_score")
    with pytest.raises(AttributeError, match="no function 'score_fn'.*functions: compute_score$"):
        load_custom_reward(str(path), "score_fn")


def test_score_batch_collects_scores_and_extra_numbers():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "plain":
            return 0.5
        return {"score": 1, "acc": True, "len": len(solution_str), "pred": solution_str}

    scores, extras = score_batch(fn, ["plain", "rich", "rich"], ["a", "bb", "ccc"],
                                 ["", "", ""], [None, {}, {}])
    assert scores == [0.5, 1.0, 1.0]
    assert set(extras) == {"acc", "len"}  # strings are not metrics
    assert math.isnan(extras["len"][0]) and extras["len"][1:] == [2.0, 3.0]
    assert extras["acc"][1:] == [1.0, 1.0]


def test_score_batch_refuses_bad_results():
    args = (["a"], ["r"], ["g"], [None])
    with pytest.raises(ValueError, match="without 'score'.*keys acc"):
        score_batch(lambda *a: {"acc": 1.0}, *args)
    with pytest.raises(TypeError, match="returned None for response 0"):
        score_batch(lambda *a: None, *args)
    with pytest.raises(ValueError, match="one of each per response"):
        score_batch(default_compute_score, ["arithmetic"], ["1", "2"], ["1", "2"], [None, None])
    scores, _ = score_batch(default_compute_score, ["arithmetic", "reverse"], ["12", "olleh"],
                            ["12", "hello"], [None, None])
    assert scores == [1.0, 0.0]
