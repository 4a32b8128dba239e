"""Tools as verl 0.9.1 has them: schemas, the tool YAML, function tools, verl's answers to bad calls,
truncation, tool_selection, verl's class names. Tools run in real worker processes here."""

import asyncio
import json
import textwrap
from types import SimpleNamespace

import pytest

from plait.agents.builtin_tools import evaluate, format_number
from plait.agents.tool_parser import FunctionCall
from plait.agents.tools import (OpenAIFunctionToolSchema, ToolBox, ToolLimits, ToolResponse,
                                normalize_function_tool_return, truncate_text)
from plait.configtree import ConfigError

GSM8K_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer"
          required: ["answer"]
"""


def multi_turn(tool_config_path=None, function_tool_path=None, max_len=256, side="middle"):
    return SimpleNamespace(tool_config_path=tool_config_path, function_tool_path=function_tool_path,
                           max_tool_response_length=max_len, tool_response_truncate_side=side)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def toolbox():
    boxes = []

    def make(*args, limits=None, **kwargs):
        box = ToolBox.from_config(multi_turn(*args, **kwargs), limits or ToolLimits(num_workers=1))
        boxes.append(box)
        return box
    yield make
    for box in boxes:
        box.close()


def call(box, *calls, tools_kwargs=None, row="row 7", selection=None):
    return asyncio.run(box.call([FunctionCall(n, a) for n, a in calls], tools_kwargs, row, selection))


# -- schemas ---------------------------------------------------------------------------------------

def test_schema_dump_keeps_what_was_given_and_drops_unknown_keys():
    raw = {"type": "function", "function": {"name": "search", "description": "d", "parameters": {
        "type": "object", "properties": {"q": {"type": "array", "item": {"type": "string"}, "description": "qs"}},
        "required": ["q"]}}}
    schema = OpenAIFunctionToolSchema.model_validate(raw)
    assert schema.function.name == "search"
    dumped = schema.model_dump(exclude_unset=True, exclude_none=True)
    assert dumped["function"]["parameters"]["properties"]["q"] == {"type": "array", "description": "qs"}  # as pydantic
    assert "strict" not in dumped["function"]
    full = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "f", "description": "d"}})
    assert full.model_dump()["function"]["parameters"] == {"type": "object", "properties": {}, "required": []}
    assert full.model_dump()["function"]["strict"] is False


@pytest.mark.parametrize("bad, match", [
    ({"type": "function", "function": {"name": "f"}}, "lacks description"),
    ({"type": "function", "function": {"name": 3, "description": "d"}}, "name must be str"),
    ({"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}, "properties.x.type"),
    ({"function": {"name": "f", "description": "d"}}, "lacks type"),
])
def test_bad_schemas_say_where(bad, match):
    with pytest.raises(ValueError, match=match):
        OpenAIFunctionToolSchema.model_validate(bad)


def test_tool_response_images_must_be_lists():
    with pytest.raises(ValueError, match="must be a list"):
        ToolResponse(image="one.png")
    assert ToolResponse().is_empty() and ToolResponse(text="x").is_text_only()


# -- verl's pure rules -----------------------------------------------------------------------------

def test_truncation_as_verl():
    text = "abcdefghij"
    assert truncate_text(text, 10, "left") == text
    assert truncate_text(text, 4, "left") == "(truncated)...ghij"
    assert truncate_text(text, 4, "right") == "abcd...(truncated)"
    assert truncate_text(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate_text(text, 5, "middle") == "ab...(truncated)...ij"
    assert truncate_text(text, 1, "middle") == "...(truncated)..." + text  # verl's text[-0:]
    assert truncate_text(None, 1, "left") is None and truncate_text("", 1, "left") == ""


def test_function_tool_returns_as_verl_reads_them():
    assert normalize_function_tool_return("hi") == (ToolResponse(text="hi"), 0.0, {})
    assert normalize_function_tool_return({"b": "é"}) == (ToolResponse(text='{"b": "é"}'), 0.0, {})
    assert normalize_function_tool_return(("r", None, None)) == (ToolResponse(text="r"), 0.0, {})
    assert normalize_function_tool_return((7, 1, {"m": 2})) == (ToolResponse(text="7"), 1.0, {"m": 2})
    with pytest.raises(TypeError, match="tuple of 4"):
        normalize_function_tool_return((1, 2, 3, 4))


def test_calculator():
    assert format_number(evaluate("(12 + 30) * 4 / 3")) == "56"
    assert format_number(evaluate("2/3")) == "0.666667"
    assert format_number(evaluate("1,200 - 0.5")) == "1199.5"
    for bad in ["__import__('os')", "2**100", "x + 1", "9" * 20]:
        with pytest.raises(ValueError):
            evaluate(bad)
    with pytest.raises(ZeroDivisionError):
        evaluate("1/0")


# -- ToolBox over real workers ---------------------------------------------------------------------

def test_gsm8k_tool_from_verls_config(tmp_path, toolbox):
    box = toolbox(write(tmp_path, "gsm8k.yaml", GSM8K_YAML))
    assert box.names == ["calc_gsm8k_reward"]
    assert box.schemas()[0]["function"]["parameters"]["required"] == ["answer"]
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    right, wrong, unknown, bad = call(box, ("calc_gsm8k_reward", '{"answer": "72"}'),
                                      ("calc_gsm8k_reward", '{"answer": 7}'), ("calc", "{}"),
                                      ("calc_gsm8k_reward", "{bad"), tools_kwargs=kwargs)
    assert (right.text, right.reward, right.error) == ("Current parsed answer='72' reward=1.0", 0.0, None)
    assert (wrong.text, wrong.reward) == ("Current parsed answer='7' reward=0.0", -0.05)
    assert unknown.text == "Unknown function 'calc'. Available tools: ['calc_gsm8k_reward']"
    assert (unknown.reward, "row 7" in unknown.error) == (0.0, True)
    assert bad.text.startswith("Invalid JSON in arguments for 'calc_gsm8k_reward': Expecting property name")
    assert bad.reward == 0.0 and bad.error
    nulls = call(box, ("calc_gsm8k_reward", '{"answer": "72"}'), tools_kwargs={"calc_gsm8k_reward": None})[0]
    assert nulls.text == "Current parsed answer='72' reward=0.0" and nulls.error is None  # a parquet null: no kwargs


GEO3K_YAML = GSM8K_YAML.replace("gsm8k_tool.Gsm8kTool", "geo3k_tool.Geo3kTool").replace("gsm8k", "geo3k")


def test_geo3k_tool_from_verls_config(tmp_path, toolbox):
    """verl's Geo3kTool (b178a3c): the answer graded as submitted by mathruler (as verl's geo3k rule with
    use_boxed=False, format_score=0), no format bonus; 0.0 step reward for an improvement, else -0.05."""
    box = toolbox(write(tmp_path, "geo3k.yaml", GEO3K_YAML))
    assert box.names == ["calc_geo3k_reward"]
    kwargs = {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "2\\sqrt{3}"}}}
    right, boxed, wrong = call(box, ("calc_geo3k_reward", '{"answer": "\\\\sqrt{12}"}'),
                               ("calc_geo3k_reward", '{"answer": "\\\\boxed{2\\\\sqrt{3}}"}'),
                               ("calc_geo3k_reward", '{"answer": 3}'), tools_kwargs=kwargs)
    assert (right.text, right.reward, right.error) == ("Current parsed answer='\\\\sqrt{12}' reward=1.0", 0.0, None)
    assert (boxed.text, boxed.reward) == ("Current parsed answer='\\\\boxed{2\\\\sqrt{3}}' reward=1.0", 0.0)  # mathruler unboxes
    assert (wrong.text, wrong.reward) == ("Current parsed answer='3' reward=0.0", -0.05)


def test_tool_selection_and_truncation(tmp_path, toolbox):
    tools = write(tmp_path, "fns.py", '''
        from plait.agents.tools import function_tool

        @function_tool
        def shout(word: str) -> str:
            """Repeat a word loudly.

            Args:
                word: the word
            """
            return word.upper() * 10

        @function_tool("add")
        async def plus(a: int, b: int = 1):
            """Add two numbers.

            Args:
                a: first
                b: second
            """
            return {"sum": a + b}, 0.5, {"calls": 1}
    ''')
    box = toolbox(function_tool_path=tools, max_len=8, side="right")
    assert box.names == ["add", "shout"]  # verl's order: function tools by name
    add = box.schemas()[0]["function"]
    assert add["parameters"] == {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                 "b": {"type": "integer", "description": "second"}}, "required": ["a"]}
    assert [s["function"]["name"] for s in box.schemas(["shout", "nope", "add", "shout"])] == ["shout", "add"]
    assert box.schemas(["nope"]) == []
    assert [s["function"]["name"] for s in box.schemas([])] == ["add", "shout"]  # empty: all, as verl
    shout, added = call(box, ("shout", '{"word": "hey"}'), ("add", '{"a": 2}'))
    assert shout.text == "HEYHEYHE...(truncated)"
    assert (added.text, added.reward, added.metrics) == ('{"sum": ...(truncated)', 0.5, {"calls": 1})
    only_add = call(box, ("shout", '{"word": "x"}'), selection=["add"])[0]
    assert only_add.text == "Unknown function 'shout'. Available tools: ['add']"


def test_a_tool_that_raises_answers_verls_error_text(tmp_path, toolbox):
    tools = write(tmp_path, "fns.py", '''
        from plait.agents.tools import function_tool

        @function_tool(schema={"type": "function", "function": {"name": "div", "description": "divide"}})
        def div(a, b):
            return a / b
    ''')
    box = toolbox(function_tool_path=tools)
    zero, ok, wrong_args = call(box, ("div", '{"a": 1, "b": 0}'), ("div", '{"a": 1, "b": 4}'), ("div", '{"c": 1}'))
    assert zero.text == "Error executing tool 'div': division by zero"
    assert zero.reward == 0.0 and zero.error == "tool div on row 7 raised ZeroDivisionError: division by zero"
    assert ok.text == "0.25" and ok.error is None
    assert wrong_args.text.startswith("Error executing tool 'div': div() got an unexpected keyword argument 'c'")


def test_base_tool_life_cycle_and_tools_kwargs(tmp_path, toolbox):
    write(tmp_path, "mytools.py", '''
        from plait.agents.tools import BaseTool, ToolResponse

        class Counter(BaseTool):
            events = []

            async def create(self, instance_id=None, **kwargs):
                self.events.append(("create", kwargs))
                return "id-1", ToolResponse()

            async def execute(self, instance_id, parameters, **kwargs):
                self.events.append(("execute", instance_id, parameters, kwargs["agent_data"].messages))
                return ToolResponse(text=repr(self.events)), None, {"n": len(self.events)}

            async def release(self, instance_id, **kwargs):
                self.events.append(("release", instance_id))
    ''')
    yaml_path = write(tmp_path, "tools.yaml", '''
        tools:
          - class_name: mytools.Counter
            config: {type: native}
            tool_schema: {type: function, function: {name: count, description: counts}}
    ''')
    import os
    import sys
    sys.path.insert(0, str(tmp_path))  # the worker imports the class as verl would: from the path and cwd
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        box = toolbox(yaml_path)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(tmp_path))
    res = asyncio.run(box.call([FunctionCall("count", '{"k": 1}')], {"count": {"create_kwargs": {"seed": 3}}},
                               "row 1", messages=[{"role": "user", "content": "hi"}]))[0]
    assert res.text == ("[('create', {'create_kwargs': {'seed': 3}}), "
                        "('execute', 'id-1', {'k': 1}, [{'role': 'user', 'content': 'hi'}])]")
    assert res.reward is None and res.metrics == {"n": 2}
    again = call(box, ("count", "{}"))[0]  # release ran after the first call; no create_kwargs this time
    assert again.text.startswith("[('create', {'create_kwargs': {'seed': 3}}), ('execute'")
    assert "('release', 'id-1'), ('create', {'create_kwargs': {}})" in again.text


# -- loading: one config error each ----------------------------------------------------------------

def test_no_tool_paths_is_no_toolbox():
    assert ToolBox.from_config(multi_turn()) is None


@pytest.mark.parametrize("class_name, match", [
    ("verl.tools.image_zoom_in_tool.ImageZoomInTool", "not run by plait: it answers with images"),
    ("verl.tools.sandbox_fusion_tools.SandboxFusionTool", "SandboxFusion"),
    ("verl.tools.mcp_search_tool.MCPSearchTool", "MCP"),
    ("no_such_module.Tool", "no_such_module, which is not installed"),
    ("Tool", "not a dotted path"),
])
def test_tools_plait_does_not_run_are_refused_by_name(tmp_path, toolbox, class_name, match):
    path = write(tmp_path, "t.yaml", f"tools:\n  - class_name: {class_name}\n    config: {{type: native}}\n")
    with pytest.raises(ConfigError, match=match) as err:
        toolbox(path)
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.tool_config_path"


def test_config_show_refuses_a_tool_plait_does_not_run_before_any_model_loads(tmp_path, capsys):
    """verl 0.9.1's agent-loop workers build every configured tool at start (its wheel has no built-in tools, so
    it stops there): plait says so at `config show` for a tool it does not run, whichever loop the rows would run."""
    from plait.cli import main
    path = write(tmp_path, "zoom.yaml", "tools:\n  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool\n"
                                        "    config: {type: native}\n")
    assert main(["config", "show", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plait: config error")]
    assert lines == [f"plait: config error: actor_rollout_ref.rollout.multi_turn.tool_config_path='{path}': tools[0]: "
                     "class_name verl.tools.image_zoom_in_tool.ImageZoomInTool is not run by plait: it answers with "
                     "images; plait's tool loop takes text responses only"]


def test_mcp_type_and_duplicates_are_refused(tmp_path, toolbox):
    mcp = write(tmp_path, "mcp.yaml", "tools:\n  - class_name: a.B\n    config: {type: mcp}\n")
    with pytest.raises(ConfigError, match="config.type is 'mcp'"):
        toolbox(mcp)
    twice = write(tmp_path, "twice.yaml", GSM8K_YAML + GSM8K_YAML.split("tools:\n", 1)[1])
    with pytest.raises(ConfigError, match="two tools are named 'calc_gsm8k_reward'"):
        toolbox(twice)
    fns = write(tmp_path, "fns.py", '''
        from plait.agents.tools import function_tool

        @function_tool("calc_gsm8k_reward", schema={"type": "function", "function": {"name": "calc_gsm8k_reward",
                                                                                  "description": "x"}})
        def f():
            return 1
    ''')
    with pytest.raises(ConfigError, match="has the name of a tool in") as err:
        toolbox(write(tmp_path, "g.yaml", GSM8K_YAML), function_tool_path=fns)
    assert err.value.key.endswith("function_tool_path")
    renamed = write(tmp_path, "renamed.py", '''
        from plait.agents.tools import function_tool

        @function_tool(schema={"type": "function", "function": {"name": "other", "description": "x"}})
        def f():
            return 1
    ''')
    with pytest.raises(ConfigError, match="its schema names 'other'"):
        toolbox(function_tool_path=renamed)


def test_a_verl_tool_file_without_verl_names_the_import_to_change(tmp_path, toolbox):
    fns = write(tmp_path, "fns.py", '''
        import json
        from verl.tools.function_tool import function_tool
    ''')
    with pytest.raises(ConfigError) as err:
        toolbox(function_tool_path=fns)
    assert ("change `from verl.tools.function_tool import function_tool` to "
            "`from plait.agents.tools import function_tool`") in str(err.value)
    assert "\n" not in str(err.value)


def test_function_file_without_tools_and_tool_without_schema(tmp_path, toolbox):
    with pytest.raises(ConfigError, match="registers no tool"):
        toolbox(function_tool_path=write(tmp_path, "empty.py", "x = 1\n"))
    with pytest.raises(ConfigError, match="no such file"):
        toolbox(function_tool_path=str(tmp_path / "missing.py"))
    no_schema = write(tmp_path, "t.yaml", "tools:\n  - class_name: plait.agents.tools.BaseTool\n    config: {type: native}\n")
    with pytest.raises(ConfigError, match="BaseTool has no tool_schema"):
        toolbox(no_schema)
    calc = write(tmp_path, "c.yaml", "tools:\n  - class_name: plait.agents.builtin_tools.CalculatorTool\n"
                                     "    config: {type: native}\n")
    box = toolbox(calc)
    assert box.names == ["calculator"] and call(box, ("calculator", '{"expression": "6*7"}'))[0].text == "42"


@pytest.mark.parametrize("import_line, fix", [
    ("from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse",
     "change `from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse` to "
     "`from plait.agents.tools import OpenAIFunctionToolSchema, ToolResponse`"),
    ("from verl.tools.base_tool import BaseTool", "to `from plait.agents.tools import BaseTool`"),
    ("import verl.utils.reward_score", "install verl, or import"),
])
def test_a_verl_tool_class_without_verl_names_the_import_to_change(tmp_path, toolbox, monkeypatch, import_line, fix):
    (tmp_path / "verl_written.py").write_text(f"import json\n{import_line}\n\n\nclass MyTool:\n    pass\n")
    path = write(tmp_path, "t.yaml", "tools:\n  - class_name: verl_written.MyTool\n    config: {type: native}\n")
    monkeypatch.chdir(tmp_path)  # tool workers import from the working directory, as verl does
    with pytest.raises(ConfigError) as err:
        toolbox(path)
    assert fix in str(err.value) and "verl_written.MyTool imports verl" in str(err.value)


def test_calculator_transcripts_for_every_synthetic_word_problem():
    import random

    from plait.agents.builtin_tools import calculator_transcript, expression_of
    from plait.agents.tool_parser import parse_tool_calls
    from plait.data.word_problems import word_problem
    rng = random.Random(0)
    problems = [word_problem(rng) for _ in range(600)]
    kinds = set()
    for question, answer in problems:
        messages = calculator_transcript(question, answer)
        assert messages is not None, question
        content, calls = parse_tool_calls(messages[2]["content"])
        assert content == "" and calls[0].name == "calculator"
        expression = json.loads(calls[0].arguments)["expression"]
        assert format_number(evaluate(expression)) == answer == messages[3]["content"]
        assert messages[4]["content"].endswith(f"#### {answer}")
        kinds.add(expression.replace(" ", "").translate(str.maketrans("", "", "0123456789")))
    assert kinds == {"+", "-", "*", "/", "+-", "*+"}  # all six of the stories' templates
    assert expression_of("What is the capital of France?") is None
    assert calculator_transcript(problems[0][0], "-1") is None


SMOL_LIKE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a "
             "helpful assistant.<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
             "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_transcript_tokenizes_as_the_tool_loop_lays_it_out(tmp_path):
    """The warm start's ids and mask for a calculator transcript equal the trajectory plait's
    tool_agent builds when the model writes the transcript's turns and the calculator answers."""
    import random

    import torch

    from plait.agents.builtin_tools import calculator_transcript, transcript_trajectory
    from plait.agents.worker import AgentWorker
    from plait.config import PlaitConfig, SamplingConfig
    from plait.data.word_problems import word_problem
    from plait.models import build_char_tokenizer
    from plait.types import PromptBatch
    from plait.workers.rollout_engine import Generation
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.chat_template = "<|im_end|>", SMOL_LIKE
    messages = calculator_transcript(*word_problem(random.Random(3)))
    expected = transcript_trajectory(tok, messages, "llama")
    turns = [m["content"] for m in messages if m["role"] == "assistant"]

    def engine(ids, max_new_tokens, sampling):  # the model writes the transcript's turns, in order
        text = turns[tok.decode(ids[0]).count("<|im_start|>assistant") - 1]
        row = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Generation(torch.tensor([row]), torch.ones(1, len(row)), torch.zeros(1, len(row)), ["eos"])

    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 512, 256
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    tools = write(tmp_path, "calc.yaml", "tools:\n  - class_name: plait.agents.builtin_tools.CalculatorTool\n"
                                         "    config: {type: native}\n")
    worker = AgentWorker(cfg, tok, "llama", ToolBox.from_config(multi_turn(tools), ToolLimits(num_workers=1)))
    try:
        batch = worker.generate(PromptBatch(prompt_ids=[[1]], data_sources=["t"], ground_truths=[messages[3]["content"]],
                                            extra_infos=[{"raw_prompt": messages[:2]}], indices=[0], agent_names=[]),
                                SamplingConfig(n=1), engine, lambda: 0)
    finally:
        worker.close()
    n = int(batch.response_attention[0].sum())
    prompt = batch.prompts[0][batch.prompt_mask[0].bool()].tolist()
    assert prompt + batch.responses[0, :n].tolist() == expected.ids
    assert [int(x) for x in batch.response_mask[0, :n].tolist()] == expected.mask
    assert 0 in expected.mask and expected.mask[-1] == 1


# -- a row's tools_kwargs --------------------------------------------------------------------------

@pytest.mark.parametrize("value, said", [
    ("ground truth 5", " is str 'ground truth 5', not a mapping of tool name"),
    ({"calc_gsm8k_reward": ["5"]}, "['calc_gsm8k_reward'] is list ['5'], not a mapping like"),
    ({"calc_gsm8k_reward": {"create_kwargs": "5"}}, "['calc_gsm8k_reward']['create_kwargs'] is str '5', not a mapping"),
])
def test_malformed_tools_kwargs_are_the_rows_fault_at_start_and_never_reload_a_worker(tmp_path, toolbox, capsys, value,
                                                                                    said):
    """Each call of such a row used to raise in the tool's worker, blamed on the tool, and replace the worker."""
    from plait.cli import main
    box = toolbox(write(tmp_path, "t.yaml", GSM8K_YAML))
    worker = box.pool.workers[0].proc.pid
    result = call(box, ("calc_gsm8k_reward", '{"answer": "5"}'), tools_kwargs=value)[0]
    assert result.error.startswith(f"row 7: extra_info.tools_kwargs{said}")
    assert result.text == "Error executing tool 'calc_gsm8k_reward': the row's tools_kwargs are malformed"
    assert box.pool.workers[0].proc.pid == worker  # nothing was asked of the worker
    good = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 5?"}], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": "5"}, "extra_info": {"tools_kwargs": value if i == 3 else good}}
            for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "--no-progress", f"trainer.default_local_dir={tmp_path / 'out'}", "demo.model_size=xs",
                 f"data.train_files=[{data}]", f"data.val_files=[{data}]", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 't.yaml'}",
                 "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "trainer.logger=[]"])
    err = capsys.readouterr().err
    assert code == 2 and f"plait: config error: data.train_files=['{data}']: row 3: extra_info.tools_kwargs{said}" in err
    assert not (tmp_path / "out" / "checkpoints").exists()
