import pytest

from plait.data.math_rewards import (gsm8k_answer, last_boxed, normalize_final_answer,
                                     normalize_math_answer)
from plait.data.rewards import default_compute_score


@pytest.mark.parametrize("response, strict, flexible", [
    ("She pays 3*6 = 18 dollars.\n#### 18", "18", "18"),
    ("#### 1,234 then #### $72", "1234", "72"),     # verl 0.9.1: "#### $72" has no number after "#### "
    ("#### -5", "-5", "-5"),
    ("The answer is 42.", None, "42."),             # flexible: the last number-like run
    ("no numbers here", None, None),
    ("####18", None, "18"),                          # strict needs the space
])
def test_gsm8k_answer_strict_and_flexible(response, strict, flexible):
    assert gsm8k_answer(response, "strict") == strict
    assert gsm8k_answer(response, "flexible") == flexible


@pytest.mark.parametrize("response, score", [
    ("so 18\n#### 18", 1.0), ("#### 17", 0.0), ("18", 0.0), ("#### 18.0", 0.0),
])
def test_gsm8k_scores_by_its_data_source(response, score):
    assert default_compute_score("openai/gsm8k", response, "18") == score


def test_gsm8k_format_score():
    from plait.data.math_rewards import gsm8k_score
    assert gsm8k_score("#### 17", "18", format_score=0.1) == 0.1
    assert gsm8k_score("17", "18", format_score=0.1) == 0.0


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{x^{2}}", "x^{2}"),
    ("\\boxed 5$ done", "5"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("a, b", [
    ("\\dfrac{1}{2}", "\\frac12"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
    ("\\left( 3, 4 \\right)", "(3,4)"), ("90^\\circ", "90"), ("10\\%", "10"),
    ("x = 3", "3"), ("\\sqrt3", "\\sqrt{3}"), (".5", "0.5"), ("5\\text{ cm}", "5"),
    ("\\$4", "4"),
])
def test_math_normalisation_equates_common_forms(a, b):
    assert normalize_math_answer(a) == normalize_math_answer(b)


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                    "HuggingFaceH4/MATH-500"])
def test_math_scores_the_last_boxed_answer(source):
    assert default_compute_score(source, "thus \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}") == 1.0
    assert default_compute_score(source, "thus \\boxed{\\frac{3}{5}}", "\\frac{3}{4}") == 0.0
    assert default_compute_score(source, "thus 3/4", "\\frac{3}{4}") == 0.0


@pytest.mark.parametrize("a, b", [
    ("The answer is $\\frac{1}{2}$.", "\\frac12"), ("1,000", "1000"), ("x=5", "5"),
    ("12 degrees", "12"), ("\\text{(B)}", "(B)"), ("\\boxed{7}", "7"),
])
def test_minerva_normalisation(a, b):
    assert normalize_final_answer(a) == normalize_final_answer(b)


def test_dapo_answer_scores_plus_minus_one():
    right = default_compute_score("math_dapo", "work...\nAnswer: 34", "34")
    assert right == {"score": 1.0, "acc": True, "pred": "34"}
    wrong = default_compute_score("math_dapo", "answer: 35\n", "34")
    assert wrong["score"] == -1.0 and wrong["acc"] is False and wrong["pred"] == "35"
    missing = default_compute_score("aime2024", "I think 34", "34")
    assert missing == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert default_compute_score("aime_2025", "Answer: 1 \nAnswer: 34", "34")["score"] == 1.0


# verl 0.9.1's scorers on the same strings (checked side by side against verl/utils/reward_score)
@pytest.mark.parametrize("source, response, truth, score", [
    ("openai/gsm8k", "#### $42", "42", 0.0),                 # no number right after "#### "
    ("openai/gsm8k", "#### 42", 42, 0.0),                    # a non-string ground truth never matches
    ("lighteval/MATH", "\\boxed{5}", 5, 0.0),
    ("lighteval/MATH", "\\boxed{50%}", "50", 0.0),            # a bare % stays (only \\% is dropped)
    ("lighteval/MATH", "\\boxed{50\\%}", "50", 1.0),
    ("lighteval/MATH", "\\boxed{5\\text{ cm}^2}", "5", 1.0),  # the unit and what follows it go
    ("lighteval/MATH", "so \\boxed 6$ and \\boxed{7}", "6", 1.0),  # "\\boxed x$" anywhere wins
    ("lighteval/MATH", "\\fbox{3}", "3", 0.0),                # verl's box reader takes \\boxed only
    ("lighteval/MATH", "\\boxed{1\\text{ a}\\text{ b}}", "1", 0.0),  # two units: raw strings compared
    ("math", "so \\boxed{34}", "34", 1.0),                   # verl routes math to the DAPO scorer
    ("math_dapo_reasoning", "Answer: 34", "34", 1.0),
])
def test_scores_equal_verl_0_9_1(source, response, truth, score):
    result = default_compute_score(source, response, truth)
    assert (result["score"] if isinstance(result, dict) else result) == score


def test_dapo_falls_back_to_the_last_boxed_answer():
    # no "Answer:" line: the last \\boxed{} of the last 100 characters, compared as written
    assert default_compute_score("aime2024", "so \\boxed{34}", "34") == {"score": 1.0, "acc": True, "pred": "34"}
    assert default_compute_score("aime2024", "so \\boxed{034}", "34")["score"] == -1.0
    far = "\\boxed{34}" + "x" * 120  # outside the last 100 characters
    assert default_compute_score("math_dapo", far, "34") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
