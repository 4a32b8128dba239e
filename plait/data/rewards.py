"""Rule-based rewards, picked by a row's `data_source`, with verl's custom-reward signature.

A reward function is a plain callable
    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
where a dict holds "score" plus any other numbers to log. `default_compute_score` scores the
built-in tasks; a user's own function is loaded from a file with `load_custom_reward`, as verl's
`custom_reward_function.{path,name}` does. Left out: model-based rewards and sandboxed execution.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import threading
from pathlib import Path
from typing import Callable

from plait.errors import Interrupted, RunError

ANSWER = {"arithmetic": re.compile(r"-?\d+"), "reverse": re.compile(r"[a-z]+")}


def extract_answer(data_source: str, solution_str: str) -> str | None:
    """The answer at the start of a response: its leading whitespace dropped, up to the first
    character that cannot be part of an answer ('19\\nabc' -> '19'); None when there is none."""
    match = ANSWER[data_source].match(solution_str.lstrip())
    return None if match is None else match.group()


def exact_match_score(data_source: str, solution_str: str, ground_truth: str,
                      format_score: float = 0.0) -> float:
    """1.0 when the extracted answer equals the ground truth; `format_score` when an answer
    was found but is wrong; 0.0 when the response does not start with an answer."""
    answer = extract_answer(data_source, solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth.strip() else format_score


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict | None = None) -> float:
    """Score a response to a built-in task (arithmetic, reverse): exact match of the answer."""
    if data_source not in SCORERS:
        raise ValueError(
            f"no built-in reward for data_source {data_source!r} (built-in: {', '.join(SCORERS)}); "
            "score it with your own function via custom_reward_function.path and .name")
    return SCORERS[data_source](data_source, solution_str, ground_truth)


def load_custom_reward(path: str | Path, name: str = "compute_score") -> Callable:
    """Import the file at `path` and return its function `name`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"custom_reward_function.path: no file at {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"plait_custom_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    # Not put in sys.modules: cloudpickle then ships the function by value to Ray workers.
    spec.loader.exec_module(module)
    fn = vars(module).get(name)
    if not callable(fn):
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise AttributeError(f"custom_reward_function.name: {str(path)!r} defines no function "
                             f"{name!r}; its functions: {', '.join(found) or 'none'}")
    return fn


def score_batch(fn: Callable, data_sources: list[str], responses: list[str],
                ground_truths: list[str], extra_infos: list[dict | None]
                ) -> tuple[list[float], dict[str, list[float]]]:
    """Call `fn` once per response. Returns the scores and, for every other numeric key that a
    dict result carried, one value per response (NaN where a response's result lacked it).
    Numbers include bools and numpy scalars; other values in a dict (strings) are not logged."""
    n = len(responses)
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(f"score_batch needs one of each per response; got {len(data_sources)} "
                         f"data sources, {n} responses, {len(ground_truths)} ground truths, "
                         f"{len(extra_infos)} extra infos")
    scores, extras = [], {}
    for i, args in enumerate(zip(data_sources, responses, ground_truths, extra_infos)):
        result = fn(*args)
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"reward function returned a dict without 'score' for response "
                                 f"{i} (data_source {args[0]!r}): keys {', '.join(result)}")
            for key, value in result.items():
                if key != "score" and isinstance(value, numbers.Real):
                    extras.setdefault(key, [math.nan] * n)[i] = float(value)
            result = result["score"]
        if not isinstance(result, numbers.Real):
            raise TypeError(f"reward function returned {result!r} for response {i} (data_source "
                            f"{args[0]!r}); expected a number or a dict with 'score'")
        scores.append(float(result))
    return scores, extras


def guard_reward(fn: Callable, name: str, timeout: float | None = None) -> Callable:
    """`fn` made safe to call from training: a NaN or infinite score, a `SystemExit` or
    `KeyboardInterrupt` raised by user code, or (with `timeout` seconds) a call that hangs, is a
    RunError naming the function, the data_source and the sample. The wrapper keeps `fn`'s
    signature for callers (positional and keyword arguments pass through)."""
    def where(args, kwargs) -> str:
        data_source = kwargs.get("data_source", args[0] if args else None)
        solution = kwargs.get("solution_str", args[1] if len(args) > 1 else None)
        return f"reward function {name} (data_source {data_source!r}, response {str(solution)[:80]!r})"

    def guarded(*args, **kwargs):
        result = _call(fn, args, kwargs, timeout, lambda: where(args, kwargs))
        score = result.get("score") if isinstance(result, dict) else result
        if isinstance(score, numbers.Real) and not math.isfinite(score):
            raise RunError(f"{where(args, kwargs)} returned {score}; rewards must be finite numbers")
        return result
    return guarded


def _call(fn: Callable, args: tuple, kwargs: dict, timeout: float | None, where: Callable[[], str]):
    def call():
        try:
            return fn(*args, **kwargs)
        except Interrupted:  # a real SIGINT/SIGTERM arriving during the call
            raise
        except (SystemExit, KeyboardInterrupt) as err:
            raise RunError(f"{where()} raised {type(err).__name__}({err}); a reward function must "
                           "return a score, not end the process") from None
    if timeout is None:
        return call()
    box: dict = {}

    def worker():
        try:
            box["result"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err
    # A daemon thread: a hung call cannot be killed from Python, but it no longer holds up the run.
    thread = threading.Thread(target=worker, daemon=True, name="plait-reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RunError(f"{where()} did not return within custom_reward_function.timeout={timeout} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


SCORERS = {
    "arithmetic": exact_match_score,
    "reverse": exact_match_score,
}
