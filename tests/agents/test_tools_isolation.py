"""Hostile tools: whatever a tool does to its worker process is one line naming the tool and the
row, the model reads an error text, and the next call works (real worker processes)."""

import asyncio
import os
import textwrap
import time
from types import SimpleNamespace

import pytest

from plait.agents.tool_parser import FunctionCall
from plait.agents.tools import ToolBox, ToolLimits

HOSTILE = '''
import asyncio, os, signal, sys, time
from plait.agents.tools import function_tool

def schema(name):
    return {"type": "function", "function": {"name": name, "description": name}}

@function_tool(schema=schema("ok"))
def ok():
    return f"pid {os.getpid()}"

@function_tool(schema=schema("hang"))
def hang():
    time.sleep(600)

@function_tool(schema=schema("hang_async"))
async def hang_async():
    await asyncio.sleep(600)

@function_tool(schema=schema("eat"))
def eat():
    return len(bytearray(2**33))

@function_tool(schema=schema("leave"))
def leave():
    sys.exit(3)

@function_tool(schema=schema("die"))
def die():
    os._exit(7)

@function_tool(schema=schema("segv"))
def segv():
    os.kill(os.getpid(), signal.SIGSEGV)

@function_tool(schema=schema("garbage"))
def garbage():
    return (object(), "not a number")

@function_tool(schema=schema("surrogate"))
def surrogate():
    return "half \\ud83d of a pair, a pair \\ud83d\\ude00"

@function_tool(schema=schema("flood"))
def flood():
    return "x" * (20 << 20)

@function_tool(schema=schema("flood_error"))
def flood_error():
    raise ValueError("\\udc80" + "y" * (20 << 20))

@function_tool(schema=schema("not_text"))
def not_text():
    from plait.agents.tools import ToolResponse
    return ToolResponse(text=123)
'''


@pytest.fixture
def box(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(textwrap.dedent(HOSTILE))
    multi_turn = SimpleNamespace(tool_config_path=None, function_tool_path=str(path), max_tool_response_length=256,
                                 tool_response_truncate_side="middle")
    box = ToolBox.from_config(multi_turn, ToolLimits(num_workers=2, timeout_s=2, memory_limit_mb=512))
    yield box
    box.close()


def run(box, *names, row="row 5 (uid a1)"):
    return asyncio.run(box.call([FunctionCall(n, "{}") for n in names], {}, row))


@pytest.mark.parametrize("name, text, error", [
    ("hang", "did not return within actor_rollout_ref.rollout.multi_turn.tool_timeout=2 s", "worker process was killed"),
    ("hang_async", "did not return within", "worker process was killed"),
    ("eat", "Error executing tool 'eat': ", "raised MemoryError"),
    ("leave", "Error executing tool 'leave': 3", "raised SystemExit"),
    ("die", "ended its worker process with exit status 7", "a tool must return its answer"),
    ("segv", "crashed with SIGSEGV", "crashed with SIGSEGV"),
    ("garbage", "Error executing tool 'garbage': could not convert string to float", "raised ValueError"),
    ("not_text", "Error executing tool 'not_text': its ToolResponse.text is int", "raised TypeError"),
])
def test_a_hostile_tool_is_one_line_and_the_next_call_works(box, name, text, error):
    trainer = os.getpid()
    result = run(box, name)[0]
    assert result.text.startswith(f"Error executing tool '{name}':") and text in result.text
    assert result.reward == 0.0
    assert result.error.startswith(f"tool {name} on row 5 (uid a1)") and error in result.error
    assert "\n" not in result.error
    assert os.getpid() == trainer
    after = run(box, "ok")[0]
    assert after.error is None and after.text.startswith("pid ") and after.text != f"pid {trainer}"


def test_tool_text_is_valid_unicode_and_bounded_before_it_leaves_the_worker(box):
    """A lone surrogate would make the tokenizer raise; 20 MiB (as an answer or as an error) is cut in the worker."""
    half, flood, error = run(box, "surrogate", "flood", "flood_error")
    assert half.error is None and half.text == "half \ufffd of a pair, a pair \U0001f600"
    assert flood.error is None and flood.text == "x" * 128 + "...(truncated)..." + "x" * 128
    assert error.text.startswith("Error executing tool 'flood_error': \ufffdyyy") and len(error.text) <= 1024
    for text in (half.text, flood.text, error.text):
        text.encode("utf-8")


def test_a_replaced_worker_loads_its_tools_outside_the_next_calls_time_limit(tmp_path):
    """Loading the tool file takes longer than a call may: after a hung call's worker is replaced, the next
    calls still answer (the replacement's loading is timed by the load limit, not theirs)."""
    path = tmp_path / "slow_to_load.py"
    path.write_text(textwrap.dedent('''
        import time
        from plait.agents.tools import function_tool
        time.sleep(2)

        @function_tool(schema={"type": "function", "function": {"name": "ok", "description": "o"}})
        def ok():
            return "fine"

        @function_tool(schema={"type": "function", "function": {"name": "hang", "description": "h"}})
        def hang():
            time.sleep(600)
    '''))
    multi_turn = SimpleNamespace(tool_config_path=None, function_tool_path=str(path), max_tool_response_length=256,
                                 tool_response_truncate_side="middle")
    box = ToolBox.from_config(multi_turn, ToolLimits(num_workers=1, timeout_s=1, load_timeout_s=30))
    try:
        assert "did not return within" in run(box, "hang")[0].error
        assert [r.text for r in run(box, "ok", "ok", "ok")] == ["fine"] * 3
    finally:
        box.close()


def test_a_hanging_call_does_not_hold_up_the_others(box):
    start = time.monotonic()
    hung, fine = run(box, "hang", "ok")
    assert "did not return" in hung.text and fine.error is None
    assert fine.seconds < hung.seconds
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("code, match", [
    ("import os\nos._exit(4)\n", "loading the tools ended its worker process with exit status 4"),
    ("import time\ntime.sleep(600)\n", "loading the tools did not return within the tools' load time limit=2 s"),
    ("x = bytearray(2**33)\n", "loading the tools raised MemoryError"),
])
def test_a_tool_file_that_breaks_its_worker_while_loading_is_one_config_error(tmp_path, code, match):
    from plait.configtree import ConfigError
    path = tmp_path / "bad.py"
    path.write_text(code)
    multi_turn = SimpleNamespace(tool_config_path=None, function_tool_path=str(path), max_tool_response_length=256,
                                 tool_response_truncate_side="middle")
    with pytest.raises(ConfigError, match=match) as err:
        ToolBox.from_config(multi_turn, ToolLimits(num_workers=1, memory_limit_mb=512, load_timeout_s=2))
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.function_tool_path" and "\n" not in str(err.value)


def test_a_replaced_worker_that_cannot_load_the_tools_again_is_one_line(tmp_path):
    path = tmp_path / "flaky.py"
    flag = tmp_path / "loaded_once"
    path.write_text(textwrap.dedent(f'''
        import os
        from pathlib import Path
        from plait.agents.tools import function_tool
        if Path({str(flag)!r}).exists():
            raise ImportError("the second load fails")
        Path({str(flag)!r}).touch()

        @function_tool(schema={{"type": "function", "function": {{"name": "die", "description": "d"}}}})
        def die():
            os._exit(1)
    '''))
    multi_turn = SimpleNamespace(tool_config_path=None, function_tool_path=str(path), max_tool_response_length=256,
                                 tool_response_truncate_side="middle")
    box = ToolBox.from_config(multi_turn, ToolLimits(num_workers=1))
    try:
        first, again = run(box, "die")[0], run(box, "die")[0]
    finally:
        box.close()
    assert "exit status 1" in first.error
    assert again.text == "Error executing tool 'die': the tools could not be loaded"
    assert again.error.startswith("tool die on row 5 (uid a1): its worker could not load the tools: ")
    assert "the second load fails" in again.error
