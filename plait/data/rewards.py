"""Rule-based rewards, picked by a row's `data_source`, called the way verl calls them.

A reward function is a plain callable, called with keyword arguments
    compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)
        -> float | dict                       (a dict holds "score" plus other numbers to log)
and may be `async def` (awaited; a batch's calls run concurrently). `ground_truth` is passed as
the row stored it (a string, a list, a dict). `default_compute_score` scores the built-in tasks
and verl's math data sources (math_rewards.py); a user's function is loaded from a file with
`load_custom_reward`, as verl's `custom_reward_function.{path,name,reward_kwargs}` does.

A reward manager (`reward_model.reward_manager`) turns a batch of decoded responses into scores:
`naive` calls the function once per response, `batch` once with lists (`data_sources=`,
`solution_strs=`, `ground_truths=`, `extra_infos=`) and `dapo` is `naive` plus DAPO's overlong
penalty. Left out: verl's `prime` manager (process pool with timeouts) and sandboxed execution.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import math
import numbers
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from plait.data.math_rewards import MATH_SOURCES, dapo_score, gsm8k_score, math_score

if TYPE_CHECKING:  # plait.config imports this module for MANAGERS
    from plait.config import OverlongBufferConfig

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


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> float | dict:
    """Score a response to a built-in task or one of verl's math data sources."""
    if data_source in SCORERS:
        return SCORERS[data_source](solution_str, ground_truth)
    if data_source.startswith("aime"):  # verl scores every AIME variant as DAPO does
        return dapo_score(solution_str, ground_truth)
    raise ValueError(
        f"no built-in reward for data_source {data_source!r} (built-in: {', '.join(SCORERS)}, aime*); "
        "score it with your own function via custom_reward_function.path and .name")


def load_custom_reward(path: str | Path, name: str = "compute_score",
                       reward_kwargs: dict | None = None) -> Callable:
    """Import the file at `path` and return its function `name`, with `reward_kwargs` bound."""
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
    # partial keeps `async def` visible to inspect.iscoroutinefunction
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


@dataclass
class ScoreRequest:
    """One batch of decoded responses and what their rewards need."""
    data_sources: list[str]
    responses: list[str]                  # decoded response text
    ground_truths: list[Any]              # as stored in the rows
    extra_infos: list[dict | None]
    response_lengths: list[int]           # tokens, for length penalties

    def __post_init__(self):
        sizes = {len(v) for v in (self.data_sources, self.ground_truths, self.extra_infos,
                                  self.response_lengths)}
        if sizes != {len(self.responses)}:
            raise ValueError(f"a ScoreRequest needs one of each per response; got {len(self.data_sources)} "
                             f"data sources, {len(self.responses)} responses, {len(self.ground_truths)} "
                             f"ground truths, {len(self.extra_infos)} extra infos, "
                             f"{len(self.response_lengths)} lengths")


Scores = tuple[list[float], dict[str, list[float]]]  # per response: score; extra metric -> values


def naive_manager(fn: Callable, req: ScoreRequest) -> Scores:
    """One call per response (verl's `naive`)."""
    calls = [fn(data_source=d, solution_str=r, ground_truth=g, extra_info=e) for d, r, g, e in
             zip(req.data_sources, req.responses, req.ground_truths, req.extra_infos)]
    if calls and inspect.isawaitable(calls[0]):
        calls = _await_all(calls)
    return collect_results(calls, req.data_sources)


def batch_manager(fn: Callable, req: ScoreRequest) -> Scores:
    """One call with lists for the whole batch (verl's `batch`); it returns one result per response."""
    results = fn(data_sources=req.data_sources, solution_strs=req.responses,
                 ground_truths=req.ground_truths, extra_infos=req.extra_infos)
    if inspect.isawaitable(results):
        results = _await_all([results])[0]
    if len(results) != len(req.responses):
        raise ValueError(f"the batch reward function returned {len(results)} results for "
                         f"{len(req.responses)} responses")
    return collect_results(list(results), req.data_sources)


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (`reward_model.overlong_buffer`): 0 up to
    max_resp_len - buffer_len tokens, then -factor * (tokens past that) / buffer_len, reaching
    -factor at max_resp_len."""
    exceed = length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def dapo_manager(fn: Callable, req: ScoreRequest, overlong: OverlongBufferConfig | None = None,
                 max_resp_len: int | None = None) -> Scores:
    """`naive` plus, with the overlong buffer on, DAPO's length penalty added to each score."""
    scores, extras = naive_manager(fn, req)
    if overlong is None or not overlong.enable:
        return scores, extras
    penalties = [overlong_penalty(n, max_resp_len, overlong.len, overlong.penalty_factor)
                 for n in req.response_lengths]
    if overlong.log:
        extras["overlong_reward"] = penalties
        extras["overlong"] = [float(p < 0) for p in penalties]
    return [s + p for s, p in zip(scores, penalties)], extras


def collect_results(results: list, data_sources: list[str]) -> Scores:
    """Scores from floats or dicts with "score"; every other numeric key of a dict becomes one
    value per response (NaN where a response's result lacked it). Numbers include bools and
    numpy scalars; other values (strings) are not logged."""
    n = len(results)
    scores, extras = [], {}
    for i, result in enumerate(results):
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"reward function returned a dict without 'score' for response "
                                 f"{i} (data_source {data_sources[i]!r}): keys {', '.join(result)}")
            for key, value in result.items():
                if key != "score" and isinstance(value, numbers.Real):
                    extras.setdefault(key, [math.nan] * n)[i] = float(value)
            result = result["score"]
        if not isinstance(result, numbers.Real):
            raise TypeError(f"reward function returned {result!r} for response {i} (data_source "
                            f"{data_sources[i]!r}); expected a number or a dict with 'score'")
        scores.append(float(result))
    return scores, extras


def _await_all(awaitables: list) -> list:
    async def gather():
        return await asyncio.gather(*awaitables)
    return asyncio.run(gather())


def make_reward(fn: Callable, manager: str = "naive", overlong: OverlongBufferConfig | None = None,
                max_resp_len: int | None = None) -> Callable[[ScoreRequest], Scores]:
    """The batch scorer a trainer calls: `fn` under the manager `manager` names (the config checks
    the names and that the overlong buffer goes with dapo)."""
    if manager == "dapo":
        return functools.partial(dapo_manager, fn, overlong=overlong, max_resp_len=max_resp_len)
    return functools.partial(MANAGERS[manager], fn)


def guard_reward(fn: Callable, name: str, timeout: float | None = None) -> Callable:
    """`fn` made safe to call from training: a NaN or infinite score, a `SystemExit` or
    `KeyboardInterrupt` raised by user code, or (with `timeout` seconds) a call that hangs, is a
    RunError naming the function, the data_source and the sample. The wrapper keeps `fn`'s
    signature for callers (positional and keyword arguments pass through)."""
    def where(args, kwargs) -> str:
        data_source = kwargs.get("data_source", args[0] if args else None)
        solution = kwargs.get("solution_str", args[1] if len(args) > 1 else None)
        return f"reward function {name} (data_source {data_source!r}, response {str(solution)[:80]!r})"

    def finite(result, args, kwargs):
        score = result.get("score") if isinstance(result, dict) else result
        if isinstance(score, numbers.Real) and not math.isfinite(score):
            raise RunError(f"{where(args, kwargs)} returned {score}; rewards must be finite numbers")
        return result

    def guarded(*args, **kwargs):
        result = _call(fn, args, kwargs, timeout, lambda: where(args, kwargs))
        if inspect.isawaitable(result):  # an `async def` reward: checked once awaited
            async def checked():
                return finite(await result, args, kwargs)
            return checked()
        return finite(result, args, kwargs)
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
    "arithmetic": functools.partial(exact_match_score, "arithmetic"),
    "reverse": functools.partial(exact_match_score, "reverse"),
    "openai/gsm8k": gsm8k_score,
    "gsm8k_synthetic": gsm8k_score,  # plait's synthetic word problems (word_problems.py), scored as GSM8K
    **{source: math_score for source in MATH_SOURCES},
    "math_dapo": dapo_score,
}

MANAGERS = {"naive": naive_manager, "batch": batch_manager, "dapo": dapo_manager}
