"""Rule-based rewards, picked by a row's `data_source`, called the way verl calls them.

A reward function is a plain callable, called with keyword arguments
    compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)
        -> float | dict                       (a dict holds "score" plus other numbers to log)
and may be `async def` (awaited; a batch's calls run concurrently). `ground_truth` is passed as
the row stored it (a string, a list, a dict). `default_compute_score` scores the built-in tasks and
verl's math, geometry3k (math_rewards.py) and Search-R1 (qa_rewards.py) data sources; a user's
function is loaded from a file with `load_custom_reward`, as verl's
`reward.custom_reward_function.{path,name,reward_kwargs}` does.

A reward manager (`reward.reward_manager.name`) turns a batch of decoded responses into scores:
`naive` calls the function once per response, `batch` once with lists (`data_sources=`,
`solution_strs=`, `ground_truths=`, `extra_infos=`) and `dapo` is `naive` plus DAPO's overlong
penalty. Code data sources (codecontests, apps, codeforces, taco) are scored on a SandboxFusion service
when `reward.sandbox_fusion.url` is set (sandbox_fusion.py), as verl does. Left out: verl's `prime`
manager (process pool with timeouts) and its local code execution without a url (prime_code).

The `reward.*` node of the config tree (verl 0.9's layout) lives here beside the code it
configures; `resolve_reward(cfg.reward, max_response_length)` turns it into the batch scorer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import math
import numbers
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from plait.configtree import ConfigError, build, check, shipped_tool_config
from plait.data.math_rewards import (DAPO_SOURCES, GEO3K_SOURCES, MATH_SOURCES, dapo_score, geo3k_score, gsm8k_score,
                                     gsm8k_synthetic_score, math_score)
from plait.data.qa_rewards import SEARCH_R1_SOURCES, search_r1_score
from plait.data.reward_pool import RewardPool, RewardSpec, describe_call, judge_tokenizer, plain_result
from plait.data.sandbox_fusion import CODE_SOURCES, in_threads, sandbox_score
from plait.errors import Interrupted, RunError
from plait.profiler.config import RoleProfilerConfig
from plait.safeload import first_line


@dataclass
class CustomRewardConfig:
    """`reward.custom_reward_function`: a user's function in a Python file."""
    path: Optional[str] = None
    name: Optional[str] = "compute_score"     # null with path null: verl's unset legacy block
    reward_kwargs: dict = field(default_factory=dict)  # extra keyword arguments for the reward function
    timeout: Optional[float] = None           # plait's own: seconds one call may take; null: no limit

    def __post_init__(self):
        self.path = shipped_tool_config(self.path, "rewards", ".py")  # a shipped reward file by name (gsm8k_judge)
        check(self.name is not None or self.path is None, "name", self.name, "the function's name when path is set")
        self.name = self.name or "compute_score"
        check(self.timeout is None or self.timeout > 0, "timeout", self.timeout, "seconds > 0, or null for no limit")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft penalty for responses in the last `len` tokens before max_response_length."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 0.0
    log: bool = False


@dataclass
class ModuleConfig:
    path: Optional[str] = None
    name: str = "custom_reward_manager"


@dataclass
class RewardManagerConfig:
    """`reward.reward_manager`: verl registers managers by name (source=register); plait has MANAGERS."""
    source: str = "register"
    name: str = "naive"
    module: ModuleConfig = field(default_factory=ModuleConfig)

    def __post_init__(self):
        check(self.source == "register", "source", self.source, "register: plait does not import reward manager "
              f"classes (source=importlib); its managers are {', '.join(MANAGERS)}")
        check(self.name in MANAGERS, "name", self.name, f"one of {', '.join(MANAGERS)}" + (
            " (verl 0.9.1 has no prime manager either: its reward loop stops with `Unknown reward manager: prime`; "
            "naive scores each response with the same default_compute_score)" if self.name == "prime" else ""))


@dataclass
class JudgeRolloutConfig:
    """`reward.reward_model.rollout`: the engine serving a judge (a causal-LM reward model, verl's GenRM) and the
    defaults of the requests the reward function sends it, verl 0.9.1's names and defaults. The vLLM tuning keys
    are read with name=vllm; verl's other engine keys are named at start (config_verl.py)."""
    name: Optional[str] = None                # hf or vllm; null: the policy's rule (vLLM when installed, else hf)
    dtype: Optional[str] = None               # null: actor_rollout_ref.model.dtype (as the rollout's; verl: bfloat16)
    temperature: float = 1.0                  # a request's defaults where it names none (verl: the server's
    top_p: float = 1.0                        # override_generation_config)
    top_k: int = -1
    prompt_length: int = 2048                 # with response_length: the context a request may hold (max_model_len
    response_length: int = 2048               # null); response_length is a request's budget where it names none
    max_model_len: Optional[int] = None
    max_num_seqs: int = 1024                  # requests in one engine round (hf) / running at once (vLLM)
    full_determinism: bool = False            # verl#7027: every request seeded (seed + replica) and sampled alone
    seed: int = 42
    gpu_memory_utilization: float = 0.5       # vLLM's, GPU only
    max_num_batched_tokens: int = 8192        # vLLM's
    enforce_eager: bool = True
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    load_format: str = "auto"

    def __post_init__(self):
        check(self.dtype in (None, "auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
              "one of auto, float32, bfloat16, float16 or null (actor_rollout_ref.model.dtype)")
        check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0: greedy)")
        check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        check(self.top_k >= -1, "top_k", self.top_k, "-1 or 0 (off) or a positive integer")
        for key in ("prompt_length", "response_length", "max_num_seqs", "max_num_batched_tokens"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "an integer >= 1")
        check(self.max_model_len is None or self.max_model_len > 1, "max_model_len", self.max_model_len,
              "an integer > 1 or null (prompt_length + response_length)")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")

    @property
    def context(self) -> int:
        """Prompt + answer tokens one request may hold."""
        return self.max_model_len or self.prompt_length + self.response_length


@dataclass
class RewardModelConfig:
    """`reward.reward_model`: a sequence-classification model whose score replaces the rule reward, or a causal LM
    served as a judge (verl's GenRM) that the reward function asks through `reward_router_address`."""
    enable: bool = False
    model_path: Optional[str] = None          # a local Hugging Face sequence-classification model or causal LM
    # plait's own (verl 0.8's reward_model.* had them):
    input_tokenizer: Optional[str] = None     # null: the actor's tokenizer
    trust_remote_code: bool = False
    micro_batch_size_per_gpu: Optional[int] = None
    max_length: Optional[int] = None
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    rollout: JudgeRolloutConfig = field(default_factory=JudgeRolloutConfig)  # a judge's engine (a causal LM only)
    # verl's reward pool (trainer.backend=ray): its own nnodes x n_gpus_per_node processes (CPU: worker
    # processes of trainer.ray.cpus_per_worker), data-parallel among themselves; off: the train pool's.
    enable_resource_pool: bool = False
    nnodes: int = 0
    n_gpus_per_node: int = 8

    def __post_init__(self):
        if self.enable_resource_pool:  # verl refuses the same
            check(self.nnodes > 0, "nnodes", self.nnodes, "> 0 with enable_resource_pool=true (the pool's nodes)")
            check(self.n_gpus_per_node > 0, "n_gpus_per_node", self.n_gpus_per_node,
                  "> 0 with enable_resource_pool=true (devices per node; CPU: worker processes per node)")
        check(not self.enable or bool(self.model_path), "model_path", self.model_path,
              "a local sequence-classification model or causal LM (a judge) directory with enable=true")
        check(self.micro_batch_size_per_gpu is None or self.micro_batch_size_per_gpu > 0,
              "micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, "> 0 or null (the whole batch)")


@dataclass
class SandboxFusionConfig:
    """`reward.sandbox_fusion`: the SandboxFusion service that scores code data sources (CODE_SOURCES)."""
    url: Optional[str] = None                 # its /run_code endpoint, http(s)://...; null: code rows are refused
    max_concurrent: int = 64                  # requests in flight at once
    memory_limit_mb: int = 1024               # each run's memory limit, sent to the service

    def __post_init__(self):
        check(self.url is None or (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))),
              "url", self.url, "an http:// or https:// address of a SandboxFusion /run_code endpoint, or null")
        check(self.max_concurrent > 0, "max_concurrent", self.max_concurrent, "requests at once, > 0")
        check(self.memory_limit_mb > 0, "memory_limit_mb", self.memory_limit_mb, "MiB > 0")


@dataclass
class RewardConfig:
    """`reward`: verl 0.9's reward tree (load_config maps verl 0.8's top-level custom_reward_function,
    reward_model and sandbox_fusion keys onto it)."""
    num_workers: int = 8                      # reward worker processes (verl's default); 0: in the trainer's process
    memory_limit_mb: Optional[int] = 4096     # plait's own: address space (RLIMIT_AS) of each worker; null: no limit
    max_processes: int = 64                   # plait's own: processes and threads reward code may start per worker
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    # The manager's arguments, as verl's DAPO recipe gives them: overlong_buffer_cfg (read into
    # overlong_buffer) and max_resp_len (default: data.max_response_length).
    reward_kwargs: dict = field(default_factory=dict)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def __post_init__(self):
        check(self.num_workers >= 0, "num_workers", self.num_workers, "a number of processes >= 0 (0: in the trainer's process)")
        check(self.memory_limit_mb is None or self.memory_limit_mb >= 64, "memory_limit_mb", self.memory_limit_mb,
              "MiB >= 64, or null for no limit")
        check(self.max_processes > 0, "max_processes", self.max_processes, "must be > 0")
        check(self.reward_manager.name != "batch" or bool(self.custom_reward_function.path), "reward_manager.name",
              "batch", "a reward file to go with it (reward.custom_reward_function.path): the batch manager calls one "
              "function with lists, and the built-in scorer takes one response at a time")
        unknown = set(self.reward_kwargs) - {"overlong_buffer_cfg", "max_resp_len"}
        check(not unknown, "reward_kwargs", self.reward_kwargs,
              f"only overlong_buffer_cfg and max_resp_len (unknown: {', '.join(sorted(unknown))})")
        if self.reward_kwargs.get("overlong_buffer_cfg") is not None:
            self.overlong_buffer = build(OverlongBufferConfig, dict(self.reward_kwargs["overlong_buffer_cfg"]),
                                         "reward_kwargs.overlong_buffer_cfg")
        if self.overlong_buffer.enable:
            manager = self.reward_manager.name
            check(manager == "dapo", "reward_manager.name", manager,
                  "dapo with the overlong buffer enabled (it is the dapo manager's penalty)")
            check(self.overlong_buffer.len > 0, "overlong_buffer.len", self.overlong_buffer.len,
                  "> 0 with the overlong buffer enabled")


# What makes `from verl.utils.reward_score import default_compute_score` import beside plait (tried with verl 0.9.1).
VERL_BESIDE = ("verl's scorers import beside plait after `pip install --no-deps verl==0.9.1 tensordict pyvers "
               "cloudpickle omegaconf antlr4-python3-runtime==4.9.3` (docs/verl.md), or copy the scorer into the file")

ANSWER = {"arithmetic": re.compile(r"-?\d+"), "reverse": re.compile(r"[a-z]+"),
          "larger_shape": re.compile(r"[a-z]+"), "count_dots": re.compile(r"\d+")}  # the last two: vision_tasks.py


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


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                          sandbox_fusion_url: str | None = None, max_concurrent: int = 64,
                          memory_limit_mb: int = 1024) -> float | dict:
    """Score a response to a built-in task, one of verl's math data sources or (with a SandboxFusion
    url, `reward.sandbox_fusion.*`) one of its code data sources."""
    if data_source in SCORERS:
        return SCORERS[data_source](solution_str, ground_truth)
    if data_source in CODE_SOURCES and sandbox_fusion_url:
        return sandbox_score(solution_str, ground_truth, sandbox_fusion_url, max_concurrent, memory_limit_mb)
    if data_source in CODE_SOURCES:
        raise ValueError(f"data_source {data_source!r} is scored by running its code: {NO_SANDBOX}")
    if has_builtin_reward(data_source):  # verl scores every AIME variant as DAPO does
        return dapo_score(solution_str, ground_truth)
    raise ValueError(f"no built-in reward for data_source {data_source!r} ({BUILTIN}); score it with your "
                     "own function via reward.custom_reward_function.path and .name")


def has_builtin_reward(data_source: Any, sandbox_fusion_url: str | None = None) -> bool:
    """Whether default_compute_score scores this data source (the driver checks every row's at start):
    the code data sources only with a SandboxFusion url."""
    return isinstance(data_source, str) and (data_source in SCORERS or data_source.startswith("aime")
                                             or (data_source in CODE_SOURCES and bool(sandbox_fusion_url)))


def unscored_sources(files_key: str, where: str, key: str, sources: list, reward_models: list,
                     sandbox_url: str | None = None) -> list[ConfigError]:
    """Rows' data sources (`key` column) that default_compute_score cannot score (the first five, each with its
    first row; a code data source without reward.sandbox_fusion.url on its own line), and the first row whose
    scorer needs a string ground truth (`reward_models`: each row's reward_model) and has another type.
    Checked at start, before any model loads: for data files (driver.check_data_sources) and for the items of
    a data.custom_cls class (custom_dataset.py)."""
    unknown, code, errors = {}, {}, []
    for i, source in enumerate(sources):
        if source is not None and not has_builtin_reward(source, sandbox_url):
            (code if source in CODE_SOURCES else unknown).setdefault(repr(source), i)
    if code:
        first, row = next(iter(code.items()))
        errors.append(ConfigError(files_key, where, f"{key} {first} (row {row}) is scored by running its code: "
                                  f"{NO_SANDBOX}"))
    if unknown:
        named = ", ".join(f"{s} (row {i})" for s, i in list(unknown.items())[:5])
        errors.append(ConfigError(files_key, where, f"{key} {named}{' and more' if len(unknown) > 5 else ''} "
                                  f"{'has' if len(unknown) == 1 else 'have'} no built-in reward ({BUILTIN}) and "
                                  "reward.custom_reward_function.path is unset: give a reward file that scores it"))
    for i, (source, rm) in enumerate(zip(sources, reward_models)):
        truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if needs_string_truth(source) and truth is not None and not isinstance(truth, str):
            errors.append(ConfigError(files_key, where, f"row {i}: {key} {source!r} is scored by the DAPO/AIME/math "
                                      f"scorer, which needs a string reward_model.ground_truth; this one is a "
                                      f"{type(truth).__name__} ({truth!r:.40}): store it as a string"))
            break
    return errors


def needs_string_truth(data_source: Any) -> bool:
    """Whether the built-in scorer of this data source raises on a ground truth that is not a string
    (DAPO's, which verl 0.9.1 uses for math_dapo, math and aime*, raises as verl's does)."""
    return has_builtin_reward(data_source) and SCORERS.get(data_source, dapo_score) is dapo_score


def import_user_file(key: str, path: str | Path, module_name: str):
    """Run the user's Python file `path` (config key `key`) as a module; an import that fails is a
    ConfigError in one line (the missing module and how to get it, or the error the file raised)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Not put in sys.modules: cloudpickle then ships the file's functions by value to Ray workers.
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:  # users' files commonly import verl's scorers or datasets
        raise ConfigError(key, str(path), f"importing it failed: {missing_module(err)}") from None
    except Exception as err:  # noqa: BLE001 - the user's module-level code; one line, not a traceback
        raise ConfigError(key, str(path), f"importing it failed: {type(err).__name__}: {first_line(err)}") from None
    return module


def missing_module(err: ModuleNotFoundError) -> str:
    """What a user file's failed import needs: the module's name and how to get it."""
    missing = (err.name or "").split(".")[0]
    if missing == "verl" and err.name != "verl" and importlib.util.find_spec("verl") is not None:
        try:
            version = f"verl {importlib.metadata.version('verl')}"
        except importlib.metadata.PackageNotFoundError:
            version = "the verl"
        return (f"no module named {err.name!r}: {version} installed here has no such module; the file needs the verl "
                "version it was written for")
    fix = VERL_BESIDE if missing == "verl" else f"install it beside plait (pip install {missing})"
    return f"no module named {err.name!r}; {fix}"


def load_custom_reward(path: str | Path, name: str = "compute_score",
                       reward_kwargs: dict | None = None) -> Callable:
    """Import the file at `path` and return its function `name`, with `reward_kwargs` bound."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"reward.custom_reward_function.path: no file at {str(path)!r}")
    module = import_user_file("reward.custom_reward_function.path", path, f"plait_custom_reward_{Path(path).stem}")
    fn = vars(module).get(name)
    if not callable(fn):
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise AttributeError(f"reward.custom_reward_function.name: {str(path)!r} defines no function "
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
    routers: list[str] | None = None      # a judge's replicas (host:port): response i asks routers[i % len]

    def __post_init__(self):
        sizes = {len(v) for v in (self.data_sources, self.ground_truths, self.extra_infos,
                                  self.response_lengths)}
        if sizes != {len(self.responses)}:
            raise ValueError(f"a ScoreRequest needs one of each per response; got {len(self.data_sources)} "
                             f"data sources, {len(self.responses)} responses, {len(self.ground_truths)} "
                             f"ground truths, {len(self.extra_infos)} extra infos, "
                             f"{len(self.response_lengths)} lengths")


Scores = tuple[list[float], dict[str, list[float]]]  # per response: score; extra metric -> values


def judge_kwargs(req: ScoreRequest, i: int) -> dict:
    """What verl adds to a reward call when a reward model is served: its router's address (here response i's
    replica, as host:port); the worker adds `reward_model_tokenizer`."""
    return {} if not req.routers else {"reward_router_address": req.routers[i % len(req.routers)]}


def naive_manager(fn: Callable, req: ScoreRequest) -> Scores:
    """One call per response (verl's `naive`)."""
    calls = [fn(data_source=d, solution_str=r, ground_truth=g, extra_info=e, **judge_kwargs(req, i)) for i, (d, r, g, e)
             in enumerate(zip(req.data_sources, req.responses, req.ground_truths, req.extra_infos))]
    if calls and inspect.isawaitable(calls[0]):
        calls = _await_all(calls)
    return collect_results(calls, req.data_sources)


def batch_manager(fn: Callable, req: ScoreRequest) -> Scores:
    """One call with lists for the whole batch (verl's `batch`); it returns one result per response."""
    results = fn(data_sources=req.data_sources, solution_strs=req.responses,
                 ground_truths=req.ground_truths, extra_infos=req.extra_infos, **judge_kwargs(req, 0))
    if inspect.isawaitable(results):
        results = _await_all([results])[0]
    if len(results) != len(req.responses):
        raise ValueError(f"the batch reward function returned {len(results)} results for "
                         f"{len(req.responses)} responses")
    return collect_results(list(results), req.data_sources)


def gdpo_manager(fn: Callable, req: ScoreRequest, experiment_name: str | None = None) -> Scores:
    """verl 0.9.1's `gdpo` manager: `naive` with the run's experiment name in each row's extra_info (GDPO's
    per-component rewards are the function's result keys, algorithm.gdpo_reward_keys)."""
    infos = [{**(e or {}), "experiment_name": experiment_name} for e in req.extra_infos]
    return naive_manager(fn, dataclasses.replace(req, extra_infos=infos))


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
                max_resp_len: int | None = None, experiment_name: str | None = None) -> Callable[[ScoreRequest], Scores]:
    """The batch scorer a trainer calls: `fn` under the manager `manager` names (the config checks
    the names and that the overlong buffer goes with dapo)."""
    if manager == "dapo":
        return functools.partial(dapo_manager, fn, overlong=overlong, max_resp_len=max_resp_len)
    if manager == "gdpo":
        return functools.partial(gdpo_manager, fn, experiment_name=experiment_name)
    return functools.partial(MANAGERS[manager], fn)


def resolve_reward(reward: RewardConfig, max_response_length: int, experiment_name: str | None = None,
                   judge: str | None = None) -> Callable[[ScoreRequest], Scores]:
    """The batch scorer: the reward function (custom or built-in) under `reward.reward_manager.name`
    (`experiment_name`: what verl's gdpo manager hands the function); `judge`: the folder of the judge the
    function asks (plait/workers/judge.py), or None."""
    max_resp_len = reward.reward_kwargs.get("max_resp_len") or max_response_length
    return make_reward(resolve_reward_fn(reward, judge), reward.reward_manager.name,
                       reward.overlong_buffer, max_resp_len, experiment_name)


JUDGE_KWARGS = ("reward_router_address", "reward_model_tokenizer")


def check_judge_function(fn: Callable, name: str) -> None:
    """A judge's reward function must take verl's two keywords (or **kwargs): a ConfigError at start, not a
    TypeError at the first reward."""
    params = inspect.signature(fn).parameters
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in JUDGE_KWARGS if k not in params and not takes]
    if missing:
        raise ConfigError("reward.custom_reward_function.name", name, f"takes no {' or '.join(missing)}: with a "
                          "judge (reward.reward_model: a causal LM) verl calls the reward function with "
                          "reward_router_address (host:port) and reward_model_tokenizer; add them (or **kwargs)")


def resolve_reward_fn(reward: RewardConfig, judge: str | None = None) -> Callable:
    """The guarded reward function, called in `reward.num_workers` worker processes (0: in this one,
    docs/reliability.md). A custom file is imported here once too, so a missing file, an import
    error or a missing function is a config error before any work. With a `judge`, each call also gets
    `reward_model_tokenizer`, the judge's tokenizer loaded where the function runs."""
    custom, sandbox = reward.custom_reward_function, reward.sandbox_fusion
    name, fn = "default_compute_score", default_compute_score
    if sandbox.url:  # as verl: only its default scorer gets the service, a custom function does not
        fn = functools.partial(in_threads, functools.partial(
            default_compute_score, sandbox_fusion_url=sandbox.url, max_concurrent=sandbox.max_concurrent,
            memory_limit_mb=sandbox.memory_limit_mb), sandbox.max_concurrent)
    if custom.path:
        try:
            name, fn = custom.name, load_custom_reward(custom.path, custom.name, custom.reward_kwargs)
        except FileNotFoundError:
            raise ConfigError("reward.custom_reward_function.path", custom.path, "no such file") from None
        except AttributeError as err:
            raise ConfigError("reward.custom_reward_function.name", custom.name, str(err)) from None
    judge_path = judge if custom.path else None
    if judge_path is not None:
        check_judge_function(fn, name)
    if reward.num_workers == 0 or not custom.path:  # plait's own scorer runs here: it is not user code
        if judge_path is not None:
            fn = functools.partial(fn, reward_model_tokenizer=judge_tokenizer(judge_path))
        return guard_reward(fn, name, custom.timeout)
    pool = RewardPool(RewardSpec(custom.path, custom.name, custom.reward_kwargs, judge_path), name,
                      reward.num_workers, custom.timeout, reward.memory_limit_mb, reward.max_processes)
    return guard_reward(pool, name)


def guard_reward(fn: Callable, name: str, timeout: float | None = None) -> Callable:
    """`fn` made safe to call from training: a result that is not a finite number or a dict with a
    numeric "score" (a string, None, NaN), a `SystemExit` or `KeyboardInterrupt` raised by user
    code, or (with `timeout` seconds) a call that hangs, is a RunError naming the function, the
    data_source and the sample. The wrapper keeps `fn`'s signature for callers (positional and
    keyword arguments pass through); a batch call's list of results is checked one by one. Results
    come back as `plain_result` makes them, so a reward gives the same record in-process and in a
    worker (numpy scalars, bools and 0-d arrays alike)."""

    def checked(result, args, kwargs):
        result = plain_result(result)
        if "data_sources" in kwargs and isinstance(result, (list, tuple)):  # the batch manager's call
            for i, one in enumerate(result):
                check_score(one, lambda: describe_call(name, (), {"data_source": kwargs["data_sources"][i],
                                                                 "solution_str": kwargs["solution_strs"][i]}))
        else:
            check_score(result, lambda: describe_call(name, args, kwargs))
        return result

    def guarded(*args, **kwargs):
        result = _call(fn, args, kwargs, timeout, lambda: describe_call(name, args, kwargs))
        if inspect.isawaitable(result):  # an `async def` reward, or a worker pool's call: checked once awaited
            async def awaited():
                try:
                    value = await result
                except Exception as err:  # noqa: BLE001 - as _call's
                    raise_as_run_error(err, lambda: describe_call(name, args, kwargs))
                return checked(value, args, kwargs)
            return awaited()
        return checked(result, args, kwargs)
    return guarded


def check_score(result: Any, where: Callable[[], str]) -> None:
    """A score is a finite number (bools and numpy scalars count) or a dict with one as "score"."""
    score = result.get("score", "no 'score'") if isinstance(result, dict) else result
    if isinstance(score, numbers.Real):
        if not math.isfinite(score):
            raise RunError(f"{where()} returned {score}; rewards must be finite numbers")
        return
    shown = f"a dict without 'score' (keys: {', '.join(map(str, result)) or 'none'})" if isinstance(result, dict) \
        and "score" not in result else f"{result!r:.80}"
    raise RunError(f"{where()} returned {shown}; a reward must be a number or a dict with a numeric 'score'")


def raise_as_run_error(err: Exception, where: Callable[[], str]) -> None:
    """What user code raised, as the one line a worker's failure gives (reward_pool._run), so a
    reward fails alike in-process and in workers. plait's own RunError and ConfigError pass, and so
    does running out of memory: in-process that is the trainer's, for its OOM dump (profiler)."""
    import torch  # loaded already: the trainer's process
    if isinstance(err, (RunError, ConfigError, MemoryError, torch.cuda.OutOfMemoryError)):
        raise err
    raise RunError(f"{where()} raised {type(err).__name__}: {first_line(err)}") from None


def _call(fn: Callable, args: tuple, kwargs: dict, timeout: float | None, where: Callable[[], str]):
    def call():
        try:
            return fn(*args, **kwargs)
        except Interrupted:  # a real SIGINT/SIGTERM arriving during the call
            raise
        except (SystemExit, KeyboardInterrupt) as err:
            raise RunError(f"{where()} raised {type(err).__name__}({err}); a reward function must "
                           "return a score, not end the process") from None
        except Exception as err:  # noqa: BLE001 - what raise_as_run_error says
            raise_as_run_error(err, where)
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
        raise RunError(f"{where()} did not return within reward.custom_reward_function.timeout={timeout} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


SCORERS = {  # data_source -> scorer; has_builtin_reward adds every aime* source
    "arithmetic": functools.partial(exact_match_score, "arithmetic"),
    "reverse": functools.partial(exact_match_score, "reverse"),
    "larger_shape": functools.partial(exact_match_score, "larger_shape"),  # "r" / "b" at the start
    "count_dots": functools.partial(exact_match_score, "count_dots"),      # the count at the start
    "openai/gsm8k": gsm8k_score,
    "gsm8k_synthetic": gsm8k_synthetic_score,  # plait's synthetic word problems: GSM8K's flexible rule, acc, strict
    **{source: math_score for source in MATH_SOURCES},
    **{source: dapo_score for source in DAPO_SOURCES},
    **{source: geo3k_score for source in GEO3K_SOURCES},
    **{source: search_r1_score for source in SEARCH_R1_SOURCES},  # Search-R1's exact match (qa_rewards.py)
}

MANAGERS = {"naive": naive_manager, "batch": batch_manager, "dapo": dapo_manager, "gdpo": gdpo_manager}
BUILTIN = f"built-in: {', '.join(SCORERS)}, aime*; with reward.sandbox_fusion.url: {', '.join(CODE_SOURCES)}"
NO_SANDBOX = ("verl 0.9.1 runs it on a SandboxFusion service (reward.sandbox_fusion.url=http://HOST:PORT/run_code) "
              "or, without one, locally (prime_code), which plait does not implement: set the url or give a reward "
              "file (reward.custom_reward_function.path)")
