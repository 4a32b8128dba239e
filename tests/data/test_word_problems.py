"""The synthetic GSM8K-style word problems: seeded, split by text, answers right, scored as GSM8K."""

import re

import pytest

from plait.data.math_rewards import gsm8k_score
from plait.data.rewards import default_compute_score
from plait.data.tasks import make_task_rows, split_of
from plait.data.word_problems import INSTRUCTION


def numbers(text):
    return [int(n) for n in re.findall(r"\d+", text)]


def test_rows_are_gsm8k_format_seeded_and_split():
    rows = make_task_rows("gsm8k_synthetic", "train", 200, seed=3)
    assert rows == make_task_rows("gsm8k_synthetic", "train", 200, seed=3)
    assert rows != make_task_rows("gsm8k_synthetic", "train", 200, seed=4)
    test = make_task_rows("gsm8k_synthetic", "test", 50, seed=3)
    questions = {r["prompt"][0]["content"] for r in rows}
    assert len(questions) == 200 and not questions & {r["prompt"][0]["content"] for r in test}
    for row in rows + test:
        text = row["prompt"][0]["content"]
        assert text.endswith(INSTRUCTION) and split_of(text) == row["extra_info"]["split"]
        assert row["data_source"] == "gsm8k_synthetic" and row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"].isdigit()


def test_answers_follow_from_the_story():
    """Each story's numbers give its answer by the operation its wording names."""
    for row in make_task_rows("gsm8k_synthetic", "train", 300, seed=0):
        text, answer = row["prompt"][0]["content"], int(row["reward_model"]["ground_truth"])
        n = numbers(text.removesuffix(INSTRUCTION))
        if "more and then gives" in text:
            assert answer == n[0] + n[1] - n[2]
        elif "gives" in text:
            assert answer == n[0] + n[1]
        elif "gave" in text:
            assert answer == n[0] - n[1]
        elif "Each" in text:
            assert answer == n[0] * n[1]
        elif "equally" in text:
            assert answer * n[1] == n[0]
        else:
            assert answer == n[0] * n[1] + n[2]
        assert answer >= 0


@pytest.mark.parametrize("response, score, strict", [("5 + 3 = 8\n#### 8", 1.0, 1.0), ("#### 7", 0.0, 0.0),
                                                     ("the answer is 8", 1.0, 0.0)])
def test_scored_with_verls_gsm8k_reward(response, score, strict):
    # verl's GSM8K rule, flexible (the last number); strict beside it
    result = default_compute_score("gsm8k_synthetic", response, "8")
    assert result == {"score": score, "acc": score, "strict": strict}
    assert (result["score"], result["strict"]) == (gsm8k_score(response, "8", method="flexible"), gsm8k_score(response, "8"))
