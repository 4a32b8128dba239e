"""Search-R1's exact-match reward for question answering, the scorer verl 0.9.1's
`default_compute_score` gives its `searchR1_*` data sources (NQ, TriviaQA, PopQA, HotpotQA,
2WikiMultihopQA, MuSiQue, Bamboogle: the rows of verl's preprocess_search_r1_dataset.py).

The answer is the text of the last `<answer>...</answer>` (spanning lines, stripped). It and each
target are normalised as SQuAD's evaluation does (lower case, ASCII punctuation dropped, the words
a/an/the dropped, whitespace collapsed); the score is 1.0 when the answer equals one of the targets
(`reward_model.ground_truth = {"target": [answers]}`, or one string), 0.25 when it does but the
response holds more than ten `<answer>` or `</answer>` tags (verl's guard against tag spam), and
0.0 otherwise or without an answer.

Left out: verl's substring variant (`compute_score_subem`, which default_compute_score never calls)
and its random printing of one response in 64.
"""

from __future__ import annotations

import re
import string
from typing import Any, Optional

SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = frozenset(string.punctuation)
MAX_TAGS = 10  # more <answer> (or </answer>) tags than this and a right answer earns a quarter


def normalize_answer(text: str) -> str:
    """'The  Eiffel-Tower!' -> 'eiffeltower' (verl's order: case, punctuation, articles, spaces)."""
    text = "".join(c for c in text.lower() if c not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def last_answer(response: str) -> Optional[str]:
    found = ANSWER_TAG.findall(response)
    return found[-1].strip() if found else None


def search_r1_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """Exact match of the last <answer> against ground_truth["target"] (one string or several)."""
    answer = last_answer(solution_str)
    if answer is None:  # verl returns before reading the ground truth
        return 0.0
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise TypeError(f"the Search-R1 scorer needs reward_model.ground_truth as {{'target': [answers]}}, got "
                        f"{type(ground_truth).__name__} {ground_truth!r:.40}")
    targets = ground_truth["target"]
    targets = [targets] if isinstance(targets, str) else targets
    said = normalize_answer(answer)
    if not any(normalize_answer(t) == said for t in targets):
        return float(format_score)
    spam = solution_str.count("<answer>") > MAX_TAGS or solution_str.count("</answer>") > MAX_TAGS
    return score / 4 if spam else float(score)
