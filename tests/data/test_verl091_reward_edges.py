"""verl 0.9.1's rule rewards on the edge cases where plait differed, each value computed with verl
0.9.1's `verl.utils.reward_score` (gsm8k, math_reward, math_dapo) on the same strings, side by side
(verl installed --no-deps beside plait, docs/verl.md), and by hand below."""

import pytest

from plait.data.math_rewards import dapo_score, gsm8k_score, gsm8k_synthetic_score, math_score


@pytest.mark.parametrize("response, truth, score", [
    ("so the total is 1,000", "1000", 0.0),   # flexible keeps the comma: "1,000" != "1000"
    ("so the total is 1,000", "1,000", 1.0),
    ("answer 12, then", "12", 0.0),           # the run of digits and commas is "12,"
    ("just . and .", ".", 1.0),               # only lone dots: the first of them
])
def test_gsm8k_flexible_compares_the_last_number_as_written(response, truth, score):
    assert gsm8k_score(response, truth, method="flexible") == score


def test_gsm8k_strict_drops_commas():
    assert gsm8k_score("#### 1,000", "1000") == 1.0


def test_the_synthetic_task_reads_thousands_separators():
    # plait's own task (word_problems.py): its scorer drops separators itself, not through verl's flexible mode
    assert gsm8k_synthetic_score("so the total is 1,000", "1000")["score"] == 1.0
    assert gsm8k_synthetic_score("so the total is 1,000.", "1000")["acc"] == 1.0
    assert gsm8k_synthetic_score("so the total is 1,001", "1000")["score"] == 0.0
    assert gsm8k_synthetic_score("no number", "1000")["score"] == 0.0


@pytest.mark.parametrize("response, truth, score", [
    ("\\boxed{\\frac }", "\\frac", 0.0),            # a \frac with nothing after it: the raw strings are compared
    ("\\boxed{\\frac }", "\\frac ", 1.0),
    ("\\boxed{\\sqrt\\sqrt3 }", "\\sqrt\\sqrt3", 0.0),  # \sqrt followed by \sqrt: raw strings again
    ("\\boxed{\\sqrt\\sqrt3 }", "\\sqrt{\\sqrt{3}}", 0.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{5\\\\\\%}", "5", 1.0),                 # 3 backslashes: \\ -> \ leaves \\%, dropped
    ("\\boxed{5\\\\\\\\%}", "5", 1.0),               # 4 backslashes
    ("\\boxed{5\\%}", "5", 1.0),
])
def test_math_normalisation_edges(response, truth, score):
    assert math_score(response, truth) == score


def test_dapo_answer_line_normalising_to_invalid_falls_back_to_the_box():
    assert dapo_score("Answer: [INVALID]\n\\boxed{42}", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert dapo_score("Answer: 7\n\\boxed{42}", "42") == {"score": -1.0, "acc": False, "pred": "7"}
    # no Answer: line and no box: the prediction is [INVALID], compared to the ground truth normalised
    assert dapo_score("no answer here", "[INVALID]") == {"score": 1.0, "acc": True, "pred": "[INVALID]"}


@pytest.mark.parametrize("truth", [42, 4.5, ["42"]])
def test_dapo_with_a_non_string_ground_truth_raises_as_verl_does(truth):
    # verl 0.9.1: AttributeError inside its normalisation; plait: one line saying what to store
    with pytest.raises(TypeError, match="needs a string ground truth.*store reward_model.ground_truth as a string"):
        dapo_score("Answer: 42", truth)
