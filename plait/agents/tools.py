"""Tools an agent loop can call, with verl 0.9.1's classes, files and answers.

A user writes tools as for verl: a `BaseTool` subclass named by `class_name` in the YAML at
`multi_turn.tool_config_path` (each entry: `class_name`, `config` with `type: native`, and an
optional `tool_schema`), or a plain function decorated with `@function_tool` in the file at
`multi_turn.function_tool_path` (its schema read from its type hints and Google-style docstring).
`ToolBox` is what the loop holds: the tools' OpenAI schemas (all, or a row's
`extra_info.tool_selection`) and `call`, which answers each parsed call as verl's
`ToolAgentLoop._call_tool` does:

- an unknown name: "Unknown function 'NAME'. Available tools: [...]"; arguments that are not JSON:
  "Invalid JSON in arguments for 'NAME': ..."; whatever the tool raises: "Error executing tool
  'NAME': ..." -- the text goes into the tool message, the call's reward is 0.0, nothing is raised;
- a `BaseTool` runs create (with the row's `tools_kwargs[NAME]["create_kwargs"]`) -> execute ->
  release; a function tool is called with the arguments as keywords and its return value read as
  verl reads it (a ToolResponse, a string, a dict as JSON, or a (response, reward, metrics) tuple);
- the response text is cut to `max_tool_response_length` characters on
  `tool_response_truncate_side` (left / right / middle, with verl's "(truncated)" markers).

Tools are user code: they run in worker processes (plait/agents/tool_pool.py) under time and
memory limits, and a call that crashes, hangs or eats memory is one line naming the tool and the
row (ToolResult.error) while the model gets verl's error text. The trainer never imports a tool.

Left out: images and video in tool responses (text only: a tool that returns them gets an error
text), MCP tools (verl 0.9.1 removed them too). verl's interactions are plait/agents/interactions.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Optional
from uuid import uuid4

logger = logging.getLogger(__name__)
# The tool workers' module, by path: they load it; this module never imports it (it imports this one).
TOOL_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_pool.py")


# -- OpenAI tool schemas (verl's pydantic models, as plain classes with the same calls) ----------

class _Schema:
    """model_validate / model_dump as pydantic's, for the fields a subclass declares: unknown keys
    are dropped (pydantic's default, so `items` or `minimum` never reach the chat template, as in
    verl) and `model_dump(exclude_unset=True)` keeps only the keys that were given."""
    _nested: dict = {}       # field -> the schema class of its value
    _nested_maps: dict = {}  # field -> the schema class of each value of its mapping

    def __post_init__(self):
        self._given = {f.name for f in fields(self)}  # built by hand: every field counts as set

    @classmethod
    def model_validate(cls, data: Any, where: str = "tool_schema"):
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a mapping, not {data!r:.60}")
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key in cls._nested_maps:
                if not isinstance(value, dict):
                    raise ValueError(f"{where}.{key} must be a mapping, not {value!r:.60}")
                value = {k: cls._nested_maps[key].model_validate(v, f"{where}.{key}.{k}") for k, v in value.items()}
            elif key in cls._nested:
                value = cls._nested[key].model_validate(value, f"{where}.{key}")
            values[key] = value
        missing = [name for name, f in known.items() if name not in values and _required(f)]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        obj = cls(**values)
        obj._given = set(values)
        obj._check(where)
        return obj

    def _check(self, where: str) -> None:
        pass

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = False, **_ignored) -> dict:
        out = {}
        for f in fields(self):
            if exclude_unset and f.name not in self._given:
                continue
            value = getattr(self, f.name)
            if isinstance(value, _Schema):
                value = value.model_dump(exclude_unset, exclude_none)
            elif isinstance(value, dict):
                value = {k: v.model_dump(exclude_unset, exclude_none) if isinstance(v, _Schema) else v
                         for k, v in value.items()}
            if exclude_none and value is None:
                continue
            out[f.name] = value
        return out


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _check_str(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be str, not {value!r:.60}")


@dataclass
class OpenAIFunctionPropertySchema(_Schema):
    type: str | list[str]
    description: Optional[str] = None
    enum: Optional[list[Any]] = None

    def _check(self, where):
        if not (isinstance(self.type, str) or (isinstance(self.type, list) and all(isinstance(t, str) for t in self.type))):
            raise ValueError(f"{where}.type must be a string or a list of strings, not {self.type!r:.60}")


@dataclass
class OpenAIFunctionParametersSchema(_Schema):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = field(default_factory=list)
    _nested_maps = {"properties": OpenAIFunctionPropertySchema}


@dataclass
class OpenAIFunctionSchema(_Schema):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False
    _nested = {"parameters": OpenAIFunctionParametersSchema}

    def _check(self, where):
        _check_str(self.name, f"{where}.name")
        _check_str(self.description, f"{where}.description")


@dataclass
class OpenAIFunctionToolSchema(_Schema):
    type: str
    function: OpenAIFunctionSchema
    _nested = {"function": OpenAIFunctionSchema}


@dataclass
class ToolResponse:
    """What a tool answers: text (plait's loop takes text only), images, video."""
    text: Optional[str] = None
    image: Optional[list[Any]] = None
    video: Optional[list[Any]] = None

    def __post_init__(self):
        for name in ("image", "video"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise ValueError(f"ToolResponse.{name} must be a list, not {type(value).__name__}; wrap one in [ ]")

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


# -- the tools a user writes ---------------------------------------------------------------------

class BaseTool:
    """A stateful tool, verl's life cycle: create an instance per call, execute, release.
    verl 0.9.1's loop never calls calc_reward itself; a tool may, from execute."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema: give one in the tool config "
                             "or override get_openai_tool_schema")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> Optional[OpenAIFunctionToolSchema]:
        return None  # verl's returns self.tool_schema, which does not exist yet when __init__ asks

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


@dataclass
class FunctionTool:
    """A stateless tool: a function the loop calls with the model's arguments as keywords."""
    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)


FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}


def function_tool(name: Optional[str | Callable] = None, *, schema: Optional[OpenAIFunctionToolSchema | dict] = None):
    """Register a function as a tool: `@function_tool`, `@function_tool("new_name")` or
    `@function_tool(schema={...})`. Without `schema`, the schema comes from the function's type
    hints and its Google-style docstring (`Args:` for every parameter), through transformers'
    get_json_schema as in verl; *args / **kwargs cannot be described and are refused."""
    def register(fn: Callable, tool_name: Optional[str]) -> Callable:
        tool_name = tool_name or fn.__name__
        if isinstance(schema, OpenAIFunctionToolSchema):
            built = schema
        elif isinstance(schema, dict):
            built = OpenAIFunctionToolSchema.model_validate(schema, f"@function_tool {tool_name}'s schema")
        else:
            built = _schema_from_fn(fn, tool_name)
        if built.function.name != tool_name:  # verl keeps both: the model would call a name the loop cannot find
            raise ValueError(f"@function_tool {tool_name!r}: its schema names {built.function.name!r}; "
                             f"give the same name, @function_tool({built.function.name!r}, schema=...)")
        existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"function tool {tool_name!r} is registered twice: {existing.fn.__qualname__} "
                             f"and {fn.__qualname__}; rename one")
        FUNCTION_TOOL_REGISTRY[tool_name] = FunctionTool(tool_name, fn, built, inspect.iscoroutinefunction(fn))
        return fn

    if callable(name) and schema is None:
        return register(name, None)
    return lambda fn: register(fn, name)


def _schema_from_fn(fn: Callable, tool_name: str) -> OpenAIFunctionToolSchema:
    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool {tool_name!r} takes {', '.join(variadic)}: *args and **kwargs cannot "
                         "be described in an OpenAI tool schema; name each parameter")
    from transformers.utils import get_json_schema  # here: the trainer never needs it
    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return OpenAIFunctionToolSchema.model_validate(raw, f"@function_tool {tool_name}'s schema")


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function tool's return value as (response, reward, metrics), read as verl 0.9.1 reads it."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"a function tool returned a tuple of {len(ret)}; return (response,), "
                            "(response, reward) or (response, reward, metrics)")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _as_response(ret[0]), reward, metrics
    return _as_response(ret), 0.0, {}


def _as_response(value: Any) -> ToolResponse:
    if is_tool_response(value):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))


def is_tool_response(value: Any) -> bool:
    """plait's ToolResponse or verl's (a tool file written against verl, run where verl is installed)."""
    return isinstance(value, ToolResponse) or type(value).__name__ == "ToolResponse"


def tools_kwargs_problem(value: Any) -> Optional[str]:
    """What is wrong with a row's `extra_info.tools_kwargs` (verl's form: {tool name: {"create_kwargs": {...},
    ...}}, any level may be null), or None. Checked per row at start (rows) and per call (user loops)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f" is {type(value).__name__} {value!r:.60}, not a mapping of tool name -> {{'create_kwargs': {{...}}}}"
    for name, entry in value.items():
        if entry is not None and not isinstance(entry, dict):
            return f"[{name!r}] is {type(entry).__name__} {entry!r:.60}, not a mapping like {{'create_kwargs': {{...}}}}"
        for key, kwargs in (entry or {}).items():
            if str(key).endswith("_kwargs") and kwargs is not None and not isinstance(kwargs, dict):
                return f"[{name!r}][{key!r}] is {type(kwargs).__name__} {kwargs!r:.60}, not a mapping of keyword arguments"
    return None


# -- the loop's side: ToolBox ----------------------------------------------------------------------

@dataclass
class ToolResult:
    """One call's answer, in the order of the calls."""
    text: str                # the tool message's content, truncated as configured (verl's error text on failure)
    reward: Optional[float]  # the tool's step reward (verl's tool_reward); 0.0 when the call failed
    metrics: dict            # the tool's metrics dict
    error: Optional[str]     # one line naming the tool and the row when the call failed
    seconds: float


@dataclass(frozen=True)
class ToolLimits:
    """How tool workers are bounded (the reward workers' machinery). The keys the config maps onto
    these are named in the failure lines."""
    num_workers: int = 2                     # tool worker processes: calls in flight at once
    timeout_s: Optional[float] = 60.0        # a call (create + execute + release) that runs longer is killed
    memory_limit_mb: Optional[int] = 4096    # address space (RLIMIT_AS) of each worker
    max_processes: int = 64                  # processes and threads tool code may start per worker
    load_timeout_s: float = 600.0            # each worker's first loading of the tools
    timeout_key: str = "actor_rollout_ref.rollout.multi_turn.tool_timeout"
    memory_key: str = "reward.memory_limit_mb"

    def __post_init__(self):
        from plait.configtree import check
        check(self.num_workers >= 1, "num_workers", self.num_workers, "tools run in >= 1 worker process")
        check(self.timeout_s is None or self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0 seconds or null")
        check(self.memory_limit_mb is None or self.memory_limit_mb >= 64, "memory_limit_mb", self.memory_limit_mb,
              "must be >= 64 MiB or null")
        check(self.max_processes > 0, "max_processes", self.max_processes, "must be > 0")


def truncate_text(text: Optional[str], max_length: int, side: str) -> Optional[str]:
    """verl's cut of a long tool response to `max_length` characters plus a marker. With side
    "middle" and max_length 1 verl keeps the whole text (text[-0:]); kept, for the same tokens."""
    if not text or len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_length:]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolBox:
    """The run's tools, seen from the loop: their schemas and `call`. Build with from_config."""

    def __init__(self, pool, schemas: list[dict], max_length: int, truncate_side: str):
        self.pool, self.max_length, self.truncate_side = pool, max_length, truncate_side
        self._schemas = {s["function"]["name"]: s for s in schemas}  # name -> schema, verl's order

    @classmethod
    def from_config(cls, multi_turn, limits: Optional[ToolLimits] = None) -> Optional["ToolBox"]:
        """The tools of `multi_turn.tool_config_path` and `function_tool_path` (None if neither),
        loaded in every worker now, so a bad file is a ConfigError before any work."""
        from plait.data.reward_pool import PoolWording, RewardPool, RewardSpec
        paths = {"tool_config_path": multi_turn.tool_config_path, "function_tool_path": multi_turn.function_tool_path}
        if not any(paths.values()):
            return None
        from plait.errors import RunError
        limits = limits or ToolLimits()
        wording = PoolWording(describe=_describe_call, timeout_key=limits.timeout_key, memory_key=limits.memory_key,
                              must="a tool must return its answer", load_timeout_key="the tools' load time limit")
        # a worker loads the tools (op "describe") when it starts, under the load time limit, so a worker
        # replaced after a failed call never spends the next call's time limit on loading them
        pool = RewardPool(RewardSpec(TOOL_WORKER, "serve", paths), "tools", limits.num_workers, limits.timeout_s,
                          limits.memory_limit_mb, limits.max_processes, wording, warmup={"op": "describe"},
                          load_timeout=limits.load_timeout_s)
        try:
            replies = _run_now([pool(op="describe") for _ in range(limits.num_workers)])  # one per worker
        except RunError as err:  # loading crashed, hung or ran out of memory
            replies = [{"load_error": str(err)}]
        except BaseException:
            pool.close()
            raise
        failed = [r for r in replies if not isinstance(r, dict) or "schemas" not in r]
        if failed:
            pool.close()
            raise _load_error(failed[0], paths)
        return cls(pool, replies[0]["schemas"], multi_turn.max_tool_response_length,
                   multi_turn.tool_response_truncate_side)

    @property
    def names(self) -> list[str]:
        return list(self._schemas)

    def schemas(self, selection: Optional[list[str]] = None) -> list[dict]:
        """The OpenAI schemas for apply_chat_template(tools=...): all, or a row's tool_selection."""
        return [self._schemas[name] for name in self._active(selection)]

    def _active(self, selection) -> list[str]:
        selection = None if selection is None else list(selection)
        if selection and self._schemas:  # verl: names it does not know are dropped, the order is the row's
            return [name for name in dict.fromkeys(selection) if name in self._schemas]
        return list(self._schemas)

    async def call(self, calls: list, tools_kwargs: Optional[dict], row: str, selection: Optional[list[str]] = None,
                   messages: Optional[list[dict]] = None) -> list[ToolResult]:
        """Each call answered as verl's _call_tool answers it, all at once, in call order; never raises
        for what a tool or the model did. `row` names the row in failure lines; `messages` is what
        a tool's execute sees as agent_data.messages."""
        active = self._active(selection)
        problem = tools_kwargs_problem(tools_kwargs)
        if problem is not None:  # the row's fault, not the tool's: no worker is asked (nor replaced)
            line = f"{row}: extra_info.tools_kwargs{problem}"
            logger.warning(line)
            return [ToolResult(f"Error executing tool '{c.name}': the row's tools_kwargs are malformed", 0.0, {}, line, 0.0)
                    for c in calls]
        return list(await asyncio.gather(*(self._one(c, active, tools_kwargs or {}, row, messages) for c in calls)))

    async def _one(self, call, active: list[str], tools_kwargs: dict, row: str, messages) -> ToolResult:
        from plait.errors import RunError
        start = time.perf_counter()

        def answer(text, reward=0.0, metrics=None, error=None, by_model=False) -> ToolResult:
            if error is not None:  # the model's mistakes are common in RL: not worth a warning each
                (logger.debug if by_model else logger.warning)(error)
            return ToolResult(text or "", reward, metrics or {}, error, time.perf_counter() - start)

        if call.name not in active:
            return answer(f"Unknown function '{call.name}'. Available tools: {active}",
                          error=f"tool {call.name!r} on {row}: no such tool (available: {', '.join(active) or 'none'})",
                          by_model=True)
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as err:
            return answer(f"Invalid JSON in arguments for '{call.name}': {err}",
                          error=f"tool {call.name} on {row}: its arguments are not JSON ({err})", by_model=True)
        try:
            out = await self.pool(op="call", name=call.name, arguments=arguments, tools_kwargs=tools_kwargs, row=row,
                                  messages=messages, max_length=self.max_length, side=self.truncate_side)
        except RunError as err:  # the worker died, hung or broke: it is replaced at the next call
            reason = str(err).removeprefix(_describe_call("tools", (), {"name": call.name, "row": row})).strip()
            return answer(f"Error executing tool '{call.name}': {reason}", error=str(err))
        if "load_error" in out:  # a replaced worker could not load the tools again
            return answer(f"Error executing tool '{call.name}': the tools could not be loaded",
                          error=f"tool {call.name} on {row}: its worker could not load the tools: {out['load_error']}")
        error = None if out["failure"] is None else f"tool {call.name} on {row} {out['failure']}"
        return answer(out["text"], out["reward"], out["metrics"], error)

    def close(self) -> None:
        self.pool.close()


def _describe_call(label: str, args: tuple, kwargs: dict) -> str:
    if "name" not in kwargs:
        return "loading the tools"
    return f"tool {kwargs['name']} on {kwargs['row']}"


def _run_now(awaitables: list) -> list:
    """Await on a thread of its own: from_config may be called with or without a running event loop."""
    async def gather():
        return await asyncio.gather(*awaitables)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, gather()).result()


def _load_error(reply: Any, paths: dict):
    from plait.configtree import ConfigError
    line = reply.get("load_error", f"{reply!r:.100}") if isinstance(reply, dict) else f"{reply!r:.100}"
    given = [k for k, v in paths.items() if v]  # with both files given, the one the line names
    key = given[0] if len(given) == 1 else "function_tool_path" if paths["function_tool_path"] in line else "tool_config_path"
    return ConfigError(f"actor_rollout_ref.rollout.multi_turn.{key}", paths[key], line)
