"""verl's tool class names and tool files, where verl may or may not be installed.

- `class_name` in a tool config is imported as verl does (a dotted module path, the class last).
  A `verl.*` name whose module does not import here (verl is absent, or verl 0.9.1's wheel lacks
  it: it ships no built-in tools) runs plait's own implementation when plait has one
  (`verl.tools.gsm8k_tool.Gsm8kTool`, `geo3k_tool.Geo3kTool`, `search_tool.SearchTool`), and is refused
  in one line with the reason when not (the sandbox, MCP and image-zoom tools).
- A user's tool file written against verl's classes runs unchanged where verl imports; where it
  does not, loading it fails with one line naming the import to change (`from verl.tools.base_tool
  import BaseTool` -> `from plait.agents.tools import BaseTool`), since plait's classes keep verl's
  signatures.

Called in tool worker processes only: importing a tool runs user code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import traceback

PLAIT_BUILTINS = {  # verl's class name -> plait's implementation of it
    "verl.tools.gsm8k_tool.Gsm8kTool": "plait.agents.builtin_tools.Gsm8kTool",
    "verl.tools.geo3k_tool.Geo3kTool": "plait.agents.builtin_tools.Geo3kTool",
    "verl.tools.search_tool.SearchTool": "plait.agents.search_tool.SearchTool",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "plait.agents.interactions.Gsm8kInteraction",
}

_NEEDS_SERVICE = ("it calls an outside service, which plait neither runs nor reaches; "
                  "write a BaseTool or @function_tool for yours")
REFUSED = {  # verl's tools that plait does not run, and why
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": f"verl's remote code sandbox (SandboxFusion): {_NEEDS_SERVICE}",
    "verl.tools.mcp_search_tool.MCPSearchTool": "an MCP tool: verl 0.9.1 removed MCP tools and plait has none",
    "verl.tools.mcp_base_tool.MCPBaseTool": "an MCP tool: verl 0.9.1 removed MCP tools and plait has none",
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "it answers with images; plait's tool loop takes text responses only",
}

# verl's names a user file imports -> where plait keeps the same signature
PLAIT_HOMES = {
    "BaseTool": "plait.agents.tools", "OpenAIFunctionToolSchema": "plait.agents.tools",
    "ToolResponse": "plait.agents.tools", "function_tool": "plait.agents.tools", "FunctionTool": "plait.agents.tools",
    "BaseInteraction": "plait.agents.interactions",
    "AgentLoopBase": "plait.agents.loop", "AgentLoopOutput": "plait.agents.loop", "register": "plait.agents.loop",
}


def refused_tool_lines(path: str) -> list[str]:
    """One line per tool of the tool config at `path` that plait refuses by class name (REFUSED, its module not
    importable here), read without running any tool code: what loading the tools at start would refuse. A
    file that does not read is left to that load to name."""
    import yaml

    from plait.safeload import load_yaml
    try:
        with open(path) as f:
            entries = (load_yaml(f) or {}).get("tools")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return []
    entries = entries if isinstance(entries, list) else []
    names = [e.get("class_name") if isinstance(e, dict) else None for e in entries]
    return [f"tools[{i}]: class_name {name} is not run by plait: {REFUSED[name]}" for i, name in enumerate(names)
            if name in REFUSED and not _imports(name.rpartition(".")[0])]


class ToolLoadError(ValueError):
    """A tool that cannot be loaded, said in one line."""


def resolve_tool_class(class_name: str) -> type:
    """The class `class_name` names: verl's import, plait's own for verl's built-ins, else refused."""
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise ToolLoadError(f"class_name {class_name!r} is not a dotted path (package.module.Class)")
    if class_name in PLAIT_BUILTINS or class_name in REFUSED:
        if not _imports(module_name):
            if class_name in REFUSED:
                raise ToolLoadError(f"class_name {class_name} is not run by plait: {REFUSED[class_name]}")
            module_name, _, attr = PLAIT_BUILTINS[class_name].rpartition(".")
    module = import_user_module(module_name, class_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ToolLoadError(f"class_name {class_name}: module {module_name} has no {attr}") from None


def import_user_module(module_name: str, what: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ToolLoadError(missing_module_line(err, what)) from None


def exec_user_file(path: str, module_name: str):
    """Run a tool file as a module (function tools register themselves while it runs)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so the file's own `from x import y` of siblings resolves as in verl
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        sys.modules.pop(module_name, None)
        raise ToolLoadError(missing_module_line(err, path)) from None
    return module


def _imports(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except Exception:  # noqa: BLE001 - a parent package (verl, verl.tools) is missing or does not import here
        return False


def missing_module_line(err: ModuleNotFoundError, what: str) -> str:
    """One line for a user file (`what`) whose import failed: for verl's modules, the import line to
    change to plait's (agent loops' files too: AgentLoopBase, AgentLoopOutput, register)."""
    missing = err.name or ""
    if missing != "verl" and not missing.startswith("verl."):
        return f"{what}: it imports {missing or err}, which is not installed here ({err})"
    line = _importing_line(err)
    names = re.findall(r"\w+", line.split(" import ", 1)[1]) if line.startswith("from ") and " import " in line else []
    homes = sorted({PLAIT_HOMES[n] for n in names if n in PLAIT_HOMES})
    if names and len(homes) == 1 and all(n in PLAIT_HOMES for n in names):
        fix = f"change `{line}` to `from {homes[0]} import {', '.join(names)}` (plait's classes keep verl's signatures)"
    else:
        fix = (f"install verl, or import {', '.join(sorted(PLAIT_HOMES))} from plait.agents.tools / plait.agents.loop "
               f"instead (the line: `{line or missing}`)")
    return f"{what} imports {missing}, which is not installed here: {fix}"


def _importing_line(err: BaseException) -> str:
    """The source line of the user's frame that raised (the import), stripped."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<")
              and os.path.basename(os.path.dirname(f.filename)) != "importlib"]
    return (frames[-1].line or "").strip() if frames else ""
