"""Tools run in worker processes, on the reward workers' machinery (plait/data/reward_pool.py).

    ToolBox.call ── pool(op="call", ...) ──▶ RewardPool: feeder thread i ──socket──▶ worker process i
      (trainer; awaits one future                                            serve(): the tools loaded once
       per call of a turn)                                                   from the config's files, one
                                                                             event loop; create -> execute
                                                                             -> release per call

Each worker loads every tool of the run (the YAML's classes, the function-tool file) at its first
request and keeps them; a call runs the whole verl life cycle in that worker, so a stateful tool's
instance never spans workers (verl 0.9.1 creates and releases one per call too). What a tool
raises comes back as verl's error text; what it does to its process (exit, crash, hang past the
time limit, memory past RLIMIT_AS) is a RunError from the pool, which ToolBox turns into one line
naming the tool and the row; the worker is replaced at the next call.

Left out: calls of one worker run one at a time (`multi_turn.tool_num_workers` is the
parallelism; verl runs async tools concurrently on one event loop).
"""

from __future__ import annotations

import asyncio
import numbers
import os
import sys
from typing import Any, Optional

import yaml

from plait.agents.compat import ToolLoadError, exec_user_file, resolve_tool_class
from plait.agents.tools import (FUNCTION_TOOL_REGISTRY, FunctionTool, OpenAIFunctionToolSchema,
                                is_tool_response, normalize_function_tool_return)
from plait.safeload import first_line, load_yaml, outside_text

# -- loading (worker side: runs user code) ------------------------------------------------------


def load_tools(tool_config_path: Optional[str], function_tool_path: Optional[str]) -> dict[str, Any]:
    """name -> tool: the YAML's tools in their order, then the function tools by name (verl's order)."""
    tools = {}
    for tool in (_native_tools(tool_config_path) if tool_config_path else []):
        if tool.name in tools:
            raise ToolLoadError(f"{tool_config_path}: two tools are named {tool.name!r}; each name must be unique")
        tools[tool.name] = tool
    for tool in (_function_tools(function_tool_path) if function_tool_path else []):
        if tool.name in tools:
            raise ToolLoadError(f"function tool {tool.name!r} in {function_tool_path} has the name of a tool in "
                                f"{tool_config_path}; each tool name must be unique")
        tools[tool.name] = tool
    return tools


def _native_tools(path: str) -> list:
    try:
        with open(path) as f:
            data = load_yaml(f)
    except yaml.YAMLError as err:  # an alias bomb too (safeload.load_yaml)
        raise ToolLoadError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ToolLoadError(f"{path}: expected a mapping with a list under 'tools' (verl's tool config)")
    return [_native_tool(path, i, entry) for i, entry in enumerate(entries)]


def _native_tool(path: str, i: int, entry: Any):
    where = f"{path}: tools[{i}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ToolLoadError(f"{where} needs class_name (a dotted path to the tool's class)")
    config = entry.get("config")
    if not isinstance(config, dict) or config.get("type") != "native":
        kind = config.get("type") if isinstance(config, dict) else None
        raise ToolLoadError(f"{where}.config.type is {kind!r}: verl 0.9.1 and plait run 'native' tools only "
                            "(MCP tools were removed)")
    schema = entry.get("tool_schema")
    try:
        schema = None if schema is None else OpenAIFunctionToolSchema.model_validate(schema, f"{where}.tool_schema")
    except ValueError as err:
        raise ToolLoadError(str(err)) from None
    return resolve_tool_class(entry["class_name"])(config=config, tool_schema=schema)


def _function_tools(path: str) -> list[FunctionTool]:
    if not os.path.isfile(path):
        raise ToolLoadError(f"function_tool_path {path}: no such file")
    verl_registry = _verl_registry()
    before, verl_before = set(FUNCTION_TOOL_REGISTRY), set(verl_registry or ())
    exec_user_file(path, "plait_function_tools_" + os.path.abspath(path).replace(os.sep, "_").replace(".", "_"))
    tools = [FUNCTION_TOOL_REGISTRY[n] for n in sorted(set(FUNCTION_TOOL_REGISTRY) - before)]
    verl_registry = _verl_registry()  # the file may have imported verl's decorator just now
    for name in sorted(set(verl_registry or ()) - verl_before):  # a file written against verl's decorator
        entry = verl_registry[name]
        schema = OpenAIFunctionToolSchema.model_validate(entry.tool_schema.model_dump(exclude_unset=True))
        tools.append(FunctionTool(entry.name, entry.fn, schema, entry.is_async))
    if not tools:
        raise ToolLoadError(f"function_tool_path {path} registers no tool: decorate each function with @function_tool")
    return sorted(tools, key=lambda t: t.name)


def _verl_registry() -> Optional[dict]:
    module = sys.modules.get("verl.tools.function_tool")
    return None if module is None else module.FUNCTION_TOOL_REGISTRY


# -- one call (worker side) ---------------------------------------------------------------------

async def run_call(tool: Any, arguments: Any, create_kwargs: dict, agent_data: Any) -> dict:
    """verl's create -> execute -> release for one call: {"text", "reward", "metrics", "failure"}
    where failure is None or what went wrong (the text is then verl's error text)."""
    name, instance_id, function = tool.name, None, isinstance(tool, FunctionTool)
    try:
        if function:
            response, reward, metrics = normalize_function_tool_return(await tool.call(arguments))
        else:
            instance_id, _ = await tool.create(create_kwargs=create_kwargs)
            response, reward, metrics = await tool.execute(instance_id, arguments, agent_data=agent_data)
        outcome = _outcome(response, reward, metrics)
    except BaseException as err:  # noqa: BLE001 - user code: the model reads verl's error text
        outcome = _failed(name, err)
    if instance_id and not function:
        try:
            await tool.release(instance_id)
        except BaseException as err:  # noqa: BLE001 - verl would let this end the run
            outcome = _failed(name, err, "release")
    return outcome


def _outcome(response: Any, reward: Any, metrics: Any) -> dict:
    if not is_tool_response(response):
        raise TypeError(f"execute returned {type(response).__name__}, not (ToolResponse, reward, metrics)")
    if response.text is not None and not isinstance(response.text, str):
        raise TypeError(f"its ToolResponse.text is {type(response.text).__name__}, not a string")
    if response.image or response.video:
        raise TypeError("it answered with images or video; plait's tool loop takes text responses only")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
        raise TypeError(f"its reward is {reward!r:.40}; a tool reward is a number or None")
    return {"text": response.text, "reward": None if reward is None else float(reward),
            "metrics": dict(metrics) if isinstance(metrics, dict) else {}, "failure": None}


def _failed(name: str, err: BaseException, stage: str = "") -> dict:
    said = f"{type(err).__name__}: {first_line(err)}"
    return {"text": f"Error executing tool '{name}': {err}", "reward": 0.0, "metrics": {},
            "failure": f"{stage} raised {said}" if stage else f"raised {said}"}


class AgentDataView:
    """What a tool's execute(..., agent_data=) sees: a copy of the row's state (changes stay in the
    worker; verl hands its live AgentData)."""

    def __init__(self, messages: list, tools_kwargs: dict, request_id: str):
        self.messages, self.tools_kwargs, self.request_id = messages, tools_kwargs, request_id
        self.metrics: dict = {}
        self.extra_fields: dict = {}


# -- the worker's entry point (loaded by the reward pool's worker as its "function") -------------

_STATE: dict = {}  # per worker process: "tools", "loop"


def serve(op: str, tool_config_path: Optional[str] = None, function_tool_path: Optional[str] = None,
          **call) -> dict:
    """op "describe": {"schemas": [...]} or {"load_error": line}; op "call": run_call's dict."""
    from plait.agents.tools import truncate_text
    if "loop" not in _STATE:
        _STATE["loop"] = asyncio.new_event_loop()
        try:
            _STATE["tools"] = load_tools(tool_config_path, function_tool_path)
        except ToolLoadError as err:
            _STATE["tools"] = str(err)
        except BaseException as err:  # noqa: BLE001 - a tool's own code failed while loading
            _STATE["tools"] = f"loading the tools raised {type(err).__name__}: {first_line(err)}"
    tools = _STATE["tools"]
    if isinstance(tools, str):
        return {"load_error": tools}
    if op == "describe":
        return {"schemas": [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools.values()]}
    view = AgentDataView(call["messages"] or [], call["tools_kwargs"], call["row"])
    # a parquet struct column fills a row's missing tools with null: none given, then
    create_kwargs = (call["tools_kwargs"].get(call["name"]) or {}).get("create_kwargs") or {}
    out = _STATE["loop"].run_until_complete(run_call(tools[call["name"]], call["arguments"], create_kwargs, view))
    if out["text"] is not None:  # bounded here, before it crosses to the trainer; an error text too
        cut = out["text"] if out["failure"] else truncate_text(out["text"], call["max_length"], call["side"])
        out["text"] = outside_text(cut, ERROR_CHARS if out["failure"] else call["max_length"] + 32)  # + the markers
    return out


ERROR_CHARS = 1024  # an error text the model reads (verl's "Error executing tool ...": the exception's whole text)
