"""The geometry3k reward (data_source `hiyouga/geometry3k`): hand-computed scores, and the same
strings scored by verl 0.9.1's `default_compute_score` side by side. The side-by-side test needs verl
installed aside, as tests/agents/test_parity_verl.py does:

    pip install --no-deps --target DIR verl==0.9.1 tensordict pyvers cloudpickle omegaconf \\
        antlr4-python3-runtime==4.9.3
    PLAIT_VERL_SITE=DIR pytest tests/data/test_geo3k_reward.py

(mathruler and pylatexenc, which verl's geo3k scorer imports, are plait's own dependencies.)
Without PLAIT_VERL_SITE that test skips, naming it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.data.rewards import default_compute_score, has_builtin_reward

GEO3K = "hiyouga/geometry3k"


@pytest.mark.parametrize("response, truth, score", [
    ("<think>3-4-5</think> so x = \\boxed{5}", "5", 1.0),       # right and well formed: 0.9 + 0.1
    ("<think>a\nb</think>\nThe answer is \\boxed{5}.\n", "5", 1.0),  # the format spans lines
    ("\\boxed{5}", "5", 0.9),                                   # right, no <think> block
    ("I think <think>a</think> \\boxed{5}", "5", 0.9),          # text before <think>: not the format
    ("<think>a</think> \\boxed{4}", "5", 0.1),                  # wrong but well formed
    ("<think>a</think> 5", "5", 0.0),                           # no box: the answer is "None"
    ("\\boxed{1} then \\boxed{5}", "5", 0.9),                   # the last box counts
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.9),                      # sympy: 1/2 - 0.5 = 0
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 0.9),                  # sympy simplifies the difference to 0
    ("\\boxed{6/4}", "3/2", 0.0),                               # fractions must be reduced alike
    ("\\boxed{3.0}", "3", 0.9),                                 # a float that is an integer
    ("\\boxed{3.5}", "3", 0.0),                                 # an integer truth wants an exact integer
    ("\\boxed{72^\\circ}", "72", 0.9),                          # degrees dropped
    ("\\boxed{7 cm}", "7", 0.9),                                # units dropped
    ("\\boxed{\\text{B}}", "b", 0.9),                           # text answers ignore case
    ("\\boxed{5", "5", 0.0),                                    # a box that does not close
])
def test_geo3k_scores_by_hand(response, truth, score):
    assert has_builtin_reward(GEO3K)
    assert default_compute_score(GEO3K, response, truth) == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("truth", [5, 2.5, ["5"]])
def test_geo3k_with_a_non_string_ground_truth_says_what_to_store(truth):
    with pytest.raises(TypeError, match="needs a string ground truth.*store reward_model.ground_truth as a string"):
        default_compute_score(GEO3K, "\\boxed{5}", truth)


# Responses a policy writes, right and wrong, well formed or not; each against several ground truths.
RESPONSES = [
    "<think>The legs are 3 and 4.</think> x = \\boxed{5}", "\\boxed{5}", "5", "<think></think>\\boxed{}",
    "<think>a</think> \\boxed{4}", "\\boxed{1} \\boxed{5}", "\\boxed{\\frac{1}{2}}", "\\boxed{\\frac12}",
    "\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{12}}", "\\boxed{2 \\sqrt 3}",
    "\\boxed{6/4}", "\\boxed{3.0}", "\\boxed{3.5}", "\\boxed{72^\\circ}", "\\boxed{72^{\\circ}}", "\\boxed{7 cm}",
    "\\boxed{\\text{B}}", "\\boxed{5", "\\boxed{1,000}", "\\boxed{(1, 2)}", "\\boxed{x^2}", "\\boxed{\\pi}",
    "\\boxed{\\dfrac{25}{2}}", "\\boxed{12.5}", "\\boxed{31.4}", "\\boxed{10\\pi}", "\\boxed{-3}", "\\boxed{None}",
    "<think>\nline\n</think>\n\nSo \\boxed{\\frac{5\\sqrt{3}}{2}}.", "\\boxed{\\frac{5 \\sqrt 3}{2}}", "\\boxed{4.33}",
    "\\boxed{a^{2}}", "\\boxed{2^{10}}", "\\boxed{1 and 2}", "\\boxed{\\$5}", "\\boxed{50\\%}", "\\boxed{\\infty}",
]
TRUTHS = ["5", "0.5", "\\frac{1}{2}", "2\\sqrt{3}", "3/2", "3", "72", "7", "b", "1000", "(1,2)", "x^2", "12.5",
          "31.4", "10\\pi", "-3", "\\frac{5\\sqrt{3}}{2}", "4.33", "a^2", "1024", "50", "None"]
VERL_SITE = os.environ.get("PLAIT_VERL_SITE")


@pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl").is_dir(),
                    reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")
def test_geo3k_equals_verl_091_side_by_side():
    cases = [(r, t) for r in RESPONSES for t in TRUTHS]
    script = ("import json, sys\nfrom verl.utils.reward_score import default_compute_score as f\n"
              "cases = json.load(sys.stdin)\n"
              f"print(json.dumps([f({GEO3K!r}, r, t) for r, t in cases]))\n")
    path = os.pathsep.join([VERL_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "VERL_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                         env=env, timeout=600, check=True).stdout
    verl = json.loads(out.strip().splitlines()[-1])
    plait = [default_compute_score(GEO3K, r, t) for r, t in cases]
    differ = [(c, p, v) for c, p, v in zip(cases, plait, verl) if p != v]
    assert not differ, f"{len(differ)} of {len(cases)} scores differ from verl 0.9.1's: {differ[:5]}"
    assert {0.0, 0.1, 0.9, 1.0} <= set(verl)  # the cases reach every score verl gives
