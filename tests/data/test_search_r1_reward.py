"""Search-R1's exact-match reward (data sources `searchR1_*`): hand-computed scores, and the same
strings scored by verl 0.9.1's `default_compute_score` side by side. The side-by-side test needs verl
installed aside, as tests/data/test_geo3k_reward.py does:

    pip install --no-deps --target DIR verl==0.9.1 tensordict pyvers cloudpickle omegaconf \\
        antlr4-python3-runtime==4.9.3
    PLAIT_VERL_SITE=DIR pytest tests/data/test_search_r1_reward.py

Without PLAIT_VERL_SITE that test skips, naming it.
"""

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.data.qa_rewards import SEARCH_R1_SOURCES, normalize_answer
from plait.data.rewards import default_compute_score, has_builtin_reward

NQ = "searchR1_nq"
PARIS = {"target": ["Paris"]}


@pytest.mark.parametrize("response, truth, score", [
    ("<answer>Paris</answer>", PARIS, 1.0),
    ("<think>France's capital</think>\n<answer> the  PARIS. </answer>", PARIS, 1.0),  # case, article, punctuation
    ("Paris", PARIS, 0.0),                                                  # no <answer>: nothing to score
    ("<answer>Paris", PARIS, 0.0),                                          # a tag that does not close
    ("<answer>London</answer> no, <answer>Paris</answer>", PARIS, 1.0),     # the last answer counts
    ("<answer>Paris</answer> no, <answer>London</answer>", PARIS, 0.0),
    ("<answer>\nNew\n  York\n</answer>", {"target": ["new york"]}, 1.0),    # spans lines; whitespace collapsed
    ("<answer>Parisian</answer>", PARIS, 0.0),                              # exact, not a substring
    ("<answer>Paris, France</answer>", PARIS, 0.0),
    ("<answer>Lyon</answer>", {"target": ["Marseille", "Lyon"]}, 1.0),      # any of the targets
    ("<answer>Paris</answer>", {"target": "Paris"}, 1.0),                   # one string as the target
    ("<answer>Paris</answer>", {"target": ("Rome", "paris")}, 1.0),
    ("<answer>Paris</answer>", {"target": np.array(["Rome", "Paris"])}, 1.0),  # a parquet list read by pandas
    ("<answer>theater</answer>", {"target": ["ater"]}, 0.0),                # "the" is dropped as a word only
    ("<answer>A. Lincoln</answer>", {"target": ["Lincoln"]}, 1.0),         # "a." -> "a" -> dropped
    ("<answer>U.S.A.</answer>", {"target": ["usa"]}, 1.0),
    ("<answer></answer>", {"target": [""]}, 1.0),                           # empty equals empty
    ("<answer>Paris</answer>" * 10, PARIS, 1.0),                            # ten tags: still a full score
    ("<answer>Paris</answer>" * 11, PARIS, 0.25),                           # eleven: a quarter
    ("</answer>" * 11 + "<answer>Paris</answer>", PARIS, 0.25),            # closing tags are counted alone
    ("<answer>" * 11 + "Paris</answer>", PARIS, 0.0),                       # the first tag opens the answer
    ("<answer>London</answer>" * 11, PARIS, 0.0),
])
def test_search_r1_scores_by_hand(response, truth, score):
    for source in SEARCH_R1_SOURCES:
        assert has_builtin_reward(source)
        assert default_compute_score(source, response, truth) == score


def test_normalisation_by_hand():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("Ça\tva  é") == "ça va é"  # only ASCII punctuation goes


def test_a_ground_truth_of_another_shape_says_what_to_store():
    with pytest.raises(TypeError, match=r"needs reward_model.ground_truth as \{'target': \[answers\]\}"):
        default_compute_score(NQ, "<answer>Paris</answer>", "Paris")
    assert default_compute_score(NQ, "no answer", "Paris") == 0.0  # verl returns before reading it


# Responses a policy writes, each against several ground truths.
ANSWERS = ["Paris", "paris", " The Paris ", "Paris.", "PARIS!", "Paris, France", "a Paris", "Parisian", "New York",
           "new-york", "New  York City", "U.S.A.", "USA", "the U.S.", "1991", "1,991", "nineteen ninety-one",
           "Guido van Rossum", "guido", "Mount Everest", "Everest", "Mt. Everest", "", "  ", "the", "An",
           "Zürich", "zurich", "Ça va", "l'Étoile", "O'Brien", "obrien", "theatre", "3.14", "314", "yes", "Yes."]
TRUTHS = [{"target": ["Paris"]}, {"target": ["New York", "NYC"]}, {"target": "USA"}, {"target": ["1991"]},
          {"target": ["Guido van Rossum"]}, {"target": ["Mount Everest", "Everest"]}, {"target": [""]},
          {"target": ["Zürich"]}, {"target": ["O'Brien"]}, {"target": ["3.14"]}, {"target": ["yes", "no"]}]


def responses() -> list[str]:
    """Answers in tags, alone or after others, with thinking and tool text around, and tag spam."""
    rng = random.Random(0)
    out = []
    for answer in ANSWERS:
        other = rng.choice(ANSWERS)
        out += [f"<answer>{answer}</answer>", f"<think>hmm</think>\n<answer> {answer} </answer>", answer,
                f"<answer>{other}</answer> then <answer>{answer}</answer>", f"<answer>{answer}</answer><answer>{other}",
                f"<answer>\n{answer}\n</answer>\n", f"<answer>{answer}</answer>" * rng.choice([10, 11, 12]),
                "<answer>" * 11 + f"<answer>{answer}</answer>", f"<answer>{answer}"]
    return out


VERL_SITE = os.environ.get("PLAIT_VERL_SITE")


@pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl").is_dir(),
                    reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")
def test_search_r1_equals_verl_091_side_by_side():
    cases = [(s, r, t) for (r, t), s in zip(itertools.product(responses(), TRUTHS),
                                            itertools.cycle(SEARCH_R1_SOURCES))]
    script = ("import json, sys\nfrom verl.utils.reward_score import default_compute_score as f\n"
              "cases = json.load(sys.stdin)\n"
              "print(json.dumps([f(s, r, t) for s, r, t in cases]))\n")
    path = os.pathsep.join([VERL_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "VERL_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                         env=env, timeout=600, check=True).stdout
    verl = json.loads(out.strip().splitlines()[-1])  # verl prints one response in 64 before this line
    plait = [default_compute_score(s, r, t) for s, r, t in cases]
    differ = [(c, p, v) for c, p, v in zip(cases, plait, verl) if p != v]
    assert not differ, f"{len(differ)} of {len(cases)} scores differ from verl 0.9.1's: {differ[:5]}"
    assert set(verl) == {0.0, 0.25, 1.0}  # the cases reach every score verl gives
