"""Parity with verl 0.9.1's own ToolAgentLoop: the same tokenizer, chat template, tools and scripted
generations through verl's loop (in a subprocess that imports verl) and through plait's; prompt
ids, response ids, attention mask, loss (response) mask, rollout log-probs, turn counts and tool
rewards must be equal, row by row.

verl runs from a side directory, never from plait's environment:

    pip install --no-deps --target DIR verl==0.9.1 tensordict pyvers cloudpickle omegaconf \\
        antlr4-python3-runtime==4.9.3 hydra-core codetiming orjson datasets multiprocess pandas \\
        python-dateutil pytz tzdata dill xxhash fsspec cachetools uvicorn fastapi starlette
    PLAIT_VERL_SITE=DIR pytest tests/agents/test_parity_verl.py

(--no-deps: verl's own requirements pin a CUDA stack; the list is what importing verl's agent
loop needs on top of plait's environment.) Without PLAIT_VERL_SITE the tests skip, naming it.
The verl side also loads the tools through plait's ToolBox where verl is importable: a tool file
written against verl's classes runs unchanged there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VERL_SITE = os.environ.get("PLAIT_VERL_SITE")
pytestmark = pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl" / "experimental").is_dir(),
                                reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")

# A ChatML template with hermes tool calls in the shape of Qwen2.5's (tools in the system turn,
# tool results grouped in one user turn as <tool_response> blocks); written for this test.
TEMPLATE = (  # newlines as {{ '\\n' }}: transformers renders with trim_blocks, which eats one after a tag
    "{%- set nl = '\\n' %}"
    "{%- if tools %}{{ '<|im_start|>system' + nl }}{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}{{ nl + nl + '# Tools' + nl + '<tools>' }}"
    "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl + '</tools><|im_end|>' + nl }}"
    "{%- elif messages[0].role != 'system' %}{{ '<|im_start|>system' + nl + 'You are a helpful assistant.<|im_end|>' + nl }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{% if not tools %}{{ '<|im_start|>system' + nl + m.content + '<|im_end|>' + nl }}{% endif %}"
    "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}{{ nl + '<tool_response>' + nl + m.content + nl + '</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>' + nl }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role }}{% if m.content %}{{ nl + m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ nl + '<tool_call>' + nl + '{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{ c.function.arguments | tojson }}{{ '}' + nl + '</tool_call>' }}{% endfor %}{{ '<|im_end|>' + nl }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant' + nl }}{% endif %}")

# One tool module, written twice: against verl's classes and against plait's (only the imports differ).
TOOLS_PY = '''
{imports}


class CheckAnswer(BaseTool):
    async def create(self, instance_id=None, **kwargs):
        self.truth = kwargs.get("create_kwargs", {{}}).get("ground_truth")
        return "one", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        right = str(parameters.get("answer")) == self.truth
        return ToolResponse(text=f"checked {{parameters.get('answer')!r}}: {{'right' if right else 'wrong'}}"), \\
            (1.0 if right else -0.25), {{}}


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


@function_tool
def shout(text: str) -> str:
    """Repeat a text loudly, at length.

    Args:
        text: what to repeat
    """
    return " ".join([text.upper()] * 20)


@function_tool
def fail(x: int) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("tool broke")
'''
VERL_IMPORTS = ("from verl.tools.base_tool import BaseTool\nfrom verl.tools.function_tool import function_tool\n"
                "from verl.tools.schemas import ToolResponse")
PLAIT_IMPORTS = "from plait.agents.tools import BaseTool, ToolResponse, function_tool"
TOOLS_YAML = """tools:
  - class_name: {module}.CheckAnswer
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: check_answer
        description: Check the final answer.
        parameters: {{type: object, properties: {{answer: {{type: string, description: the answer}}}}, required: [answer]}}
"""


def call(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


# Each row: the model's turns in order (the k-th request of the row gets turns[k]), its tools_kwargs
# and extra_info. The configs: (response_length, multi_turn settings).
ROWS = [
    {"turns": ["Let me add.\n" + call("add", {"a": 2, "b": 3}), "The answer is 5."]},
    {"turns": [call("check_answer", {"answer": "7"}) + call("shout", {"text": "hey"}) + call("add", {"a": 1, "b": 1}),
               call("check_answer", {"answer": 5}), "#### 5"],
     "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": "5"}}}},
    {"turns": ['<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json}</tool_call>'
               '<tool_call>{"name": "add", "arguments": "not an object"}</tool_call>',
               call("fail", {"x": 1}), "done"]},
    {"turns": [call("add", {"a": i, "b": i}) for i in range(6)]},  # only max_assistant_turns stops it
    {"turns": [call("shout", {"text": "x"}), "ok"], "extra_info": {"tool_selection": ["add", "nope"]}},
    {"turns": ["No tools needed: " + "9" * 30]},
]
CONFIGS = [
    (400, {"max_parallel_calls": 2, "max_assistant_turns": 4, "max_user_turns": None,
           "max_tool_response_length": 40, "tool_response_truncate_side": "left"}),
    (120, {"max_parallel_calls": 1, "max_assistant_turns": None, "max_user_turns": 2,
           "max_tool_response_length": 30, "tool_response_truncate_side": "middle"}),
    (60, {"max_parallel_calls": 3, "max_assistant_turns": None, "max_user_turns": None,
          "max_tool_response_length": 256, "tool_response_truncate_side": "right"}),
]
PROMPT_LENGTH = 1200


def messages(i):
    return [{"role": "user", "content": f"Row {i}: what is 2 + 3?"}]


def logprob(token_id):
    return -((token_id % 7) + 1) / 8


# verl side: an LLM server that answers each request with its row's next scripted turn (+ eos), and
# deterministic log-probs; both verl-side scripts define `tok`, `eos` and import TokenOutput before it
SCRIPTED_SERVER = '''

class Server:
    def __init__(self, turns):
        self.turns = list(turns)

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        ids = tok.encode(self.turns.pop(0), add_special_tokens=False) + [eos]
        return TokenOutput(token_ids=ids, log_probs=[-((t % 7) + 1) / 8 for t in ids])
'''

VERL_SIDE = '''
import asyncio, json, sys
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.tool_registry import load_all_tools
from verl.workers.rollout.replica import TokenOutput

spec = json.load(open(sys.argv[1]))
tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
eos = tok.convert_tokens_to_ids("<|im_end|>")
tools = load_all_tools(spec["tool_config_path"], spec["function_tool_path"])
''' + SCRIPTED_SERVER + '''

async def one(cfg, row, i):
    loop = ToolAgentLoop(DictConfigWrap(cfg), Server(row["turns"]), tok, None, None, DictConfigWrap(OmegaConf.create({})),
                         hf_model_type="qwen2", tools=ToolListWrap(tools))
    out = await loop.run({"temperature": 1.0}, raw_prompt=spec["messages"][i], tools_kwargs=row.get("tools_kwargs", {}),
                         extra_info=row.get("extra_info", {}))
    return {"prompt_ids": out.prompt_ids, "response_ids": out.response_ids, "response_mask": out.response_mask,
            "response_logprobs": out.response_logprobs, "num_turns": out.num_turns,
            "tool_rewards": out.extra_fields["tool_rewards"]}


results = []
for response_length, multi_turn in spec["configs"]:
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": spec["prompt_length"], "response_length": response_length, "full_determinism": False,
        "multi_turn": {**multi_turn, "format": "hermes"}}}})
    results.append([asyncio.run(one(cfg, row, i)) for i, row in enumerate(spec["rows"])])
print("RESULT " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from plait.models import build_char_tokenizer
    root = tmp_path_factory.mktemp("parity")
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root / "tokenizer")
    files = {}
    for side, imports in (("verl", VERL_IMPORTS), ("plait", PLAIT_IMPORTS)):
        module = f"parity_tools_{side}"  # the class's module; the function tools in a file of their own (verl
        classes, functions = TOOLS_PY.format(imports=imports).split("\n\n@function_tool", 1)  # registers them once)
        (root / f"{module}.py").write_text(classes)
        (root / f"{side}_functions.py").write_text(imports + "\n\n@function_tool" + functions)
        (root / f"{side}_tools.yaml").write_text(TOOLS_YAML.format(module=module))
        files[side] = {"tool_config_path": str(root / f"{side}_tools.yaml"),
                       "function_tool_path": str(root / f"{side}_functions.py")}
    return root, files


def verl_results(root, files):
    spec = root / "spec.json"
    spec.write_text(json.dumps({"tokenizer": str(root / "tokenizer"), **files["verl"], "rows": ROWS,
                                "configs": CONFIGS, "prompt_length": PROMPT_LENGTH,
                                "messages": [messages(i) for i in range(len(ROWS))]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([VERL_SITE, str(root)]), "VERL_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, "-c", VERL_SIDE, str(spec)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


class ScriptedEngine:
    """plait's engine round: each request's next turn from its row's script, found by the row
    marker in the prompt and the number of assistant turns so far; log-probs as the verl side's."""

    def __init__(self, tok):
        self.tok, self.eos = tok, tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, ids, max_new_tokens, sampling):
        import torch
        from plait.workers.rollout_engine import Generation
        rows = []
        for p in ids:
            text = self.tok.decode(p)
            row = int(text.split("Row ", 1)[1].split(":", 1)[0])
            turn = text.count("<|im_start|>assistant") - 1
            rows.append((self.tok.encode(ROWS[row]["turns"][turn], add_special_tokens=False) + [self.eos])[:max_new_tokens])
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.tok.pad_token_id)
        mask, logp = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            out[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
            logp[i, :len(r)] = torch.tensor([logprob(t) for t in r])
        return Generation(out, mask, logp, ["eos" if r[-1] == self.eos else "length" for r in rows])


def plait_results(root, files):
    from types import SimpleNamespace

    from plait.agents.tools import ToolBox, ToolLimits
    from plait.agents.worker import AgentWorker
    from plait.config import PlaitConfig, SamplingConfig
    from plait.models import load_tokenizer
    from plait.types import PromptBatch
    tok = load_tokenizer(root / "tokenizer")
    cwd = os.getcwd()
    os.chdir(root)  # the YAML's class_name is a module in root: tool workers import from the cwd, as verl does
    results = []
    try:
        for response_length, multi_turn in CONFIGS:
            cfg = PlaitConfig()
            cfg.data.max_prompt_length, cfg.data.max_response_length = PROMPT_LENGTH, response_length
            for k, v in multi_turn.items():
                setattr(cfg.actor_rollout_ref.rollout.multi_turn, k, v)
            cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
            mt = SimpleNamespace(**files["plait"], max_tool_response_length=multi_turn["max_tool_response_length"],
                                 tool_response_truncate_side=multi_turn["tool_response_truncate_side"])
            box = ToolBox.from_config(mt, ToolLimits(num_workers=2))
            worker = AgentWorker(cfg, tok, "qwen2", box)
            prompts = PromptBatch(prompt_ids=[[1]] * len(ROWS), data_sources=["t"] * len(ROWS),
                                  ground_truths=["5"] * len(ROWS), indices=list(range(len(ROWS))), agent_names=[],
                                  extra_infos=[{"raw_prompt": messages(i), "tools_kwargs": r.get("tools_kwargs", {}),
                                                **r.get("extra_info", {})} for i, r in enumerate(ROWS)])
            try:
                batch = worker.generate(prompts, SamplingConfig(n=1), ScriptedEngine(tok), lambda: 0)
            finally:
                worker.close()
            results.append([row_of(batch, i) for i in range(len(ROWS))])
    finally:
        os.chdir(cwd)
    return results


def row_of(batch, i):
    n = int(batch.response_attention[i].sum())
    assert batch.response_attention[i, :n].eq(1).all() and batch.response_attention[i, n:].eq(0).all()
    prompt = batch.prompts[i][batch.prompt_mask[i].bool()]
    return {"prompt_ids": prompt.tolist(), "response_ids": batch.responses[i, :n].tolist(),
            "response_mask": [int(x) for x in batch.response_mask[i, :n].tolist()],
            "response_logprobs": batch.rollout_logprobs[i, :n].tolist(), "num_turns": batch.agent_infos[i]["num_turns"],
            "tool_rewards": batch.extra_infos[i]["tool_rewards"]}


def test_plait_tool_agent_equals_verls_byte_for_byte(setup):
    root, files = setup
    theirs, ours = verl_results(root, files), plait_results(root, files)
    for c, (v_rows, p_rows) in enumerate(zip(theirs, ours)):
        for i, (v, p) in enumerate(zip(v_rows, p_rows)):
            where = f"config {c}, row {i}"
            for key in ("prompt_ids", "response_ids", "response_mask", "num_turns", "tool_rewards"):
                assert p[key] == v[key], f"{where}: {key} differs"
            assert p["response_logprobs"] == pytest.approx(v["response_logprobs"], abs=1e-7), where
    # what the rows exercised: tool tokens (mask 0), a cut at the response budget, a tool error text
    assert any(0 in r["response_mask"] for rows in ours for r in rows)
    assert any(len(r["response_ids"]) == CONFIGS[c][0] for c, rows in enumerate(ours) for r in rows)
    assert any(-0.25 in r["tool_rewards"] for rows in ours for r in rows)


TOOLBOX_SIDE = '''
import asyncio, json, sys
from types import SimpleNamespace
from plait.agents.tool_parser import FunctionCall
from plait.agents.tools import ToolBox, ToolLimits

mt = SimpleNamespace(**json.loads(sys.argv[1]), max_tool_response_length=30, tool_response_truncate_side="middle")
calls = [FunctionCall(n, json.dumps(a)) for n, a in json.loads(sys.argv[2])]
box = ToolBox.from_config(mt, ToolLimits(num_workers=1))
try:
    results = asyncio.run(box.call(calls, {"check_answer": {"create_kwargs": {"ground_truth": "5"}}}, "row 0"))
finally:
    box.close()
print("RESULT " + json.dumps([[r.text, r.reward, r.error] for r in results]))
'''
CALLS = [("check_answer", {"answer": "5"}), ("check_answer", {"answer": 4}), ("add", {"a": 40, "b": 2}),
         ("shout", {"text": "ho"}), ("fail", {"x": 0})]


def toolbox_results(files, pythonpath, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    done = subprocess.run([sys.executable, "-c", TOOLBOX_SIDE, json.dumps(files), json.dumps(CALLS)], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_a_tool_file_written_for_verl_runs_unchanged_where_verl_imports(setup):
    root, files = setup
    plait_root = str(Path(__file__).resolve().parents[2])
    with_verl = toolbox_results(files["verl"], [plait_root, VERL_SITE], root)
    plait_only = toolbox_results(files["plait"], [plait_root], root)
    assert with_verl == plait_only
    assert with_verl[0] == ["checked '5': right", 1.0, None]
    assert with_verl[3][0] == "HO HO HO HO HO ...(truncated)... HO HO HO HO HO"  # 15 + 15 characters
    assert with_verl[4][0] == "Error executing tool 'fail': tool broke" and "RuntimeError" in with_verl[4][2]


PARSER_SIDE = '''
import asyncio, json, sys
from verl.experimental.agent_loop.tool_parser import HermesToolParser


class Text:  # the parser decodes ids; here the "ids" are the text
    def decode(self, text):
        return text


parser = HermesToolParser(Text())
out = [asyncio.run(parser.extract_tool_calls(t)) for t in json.loads(sys.argv[1])]
print("RESULT " + json.dumps([[content, [[c.name, c.arguments] for c in calls]] for content, calls in out]))
'''
TURNS = [
    "The answer is 42.<|im_end|>", 'cut <tool_call>{"name": "calc", "arguments": {"x": 1}}',
    'Check.\n<tool_call>\n{"name": "c", "arguments": {"answer": "72"}}\n</tool_call><|im_end|>',
    '<tool_call>{"name":"f","arguments":{"b":[1,2],"a":"é"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "g", "arguments": null}</tool_call>',
    'a<tool_call>{"name": "one", "arguments": {}}</tool_call>b<tool_call>{not json}</tool_call>c'
    '<tool_call>{"name": "no_args"}</tool_call>d<tool_call>["a list"]</tool_call>e'
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>f<tool_call>{"name": "two", "arguments": {"k": 2}}</tool_call>g',
    '<tool_call>{"name": "a",\n "arguments": {"s": "x"}}</tool_call> mid <tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"',
    "</tool_call> oops <tool_call>", '<tool_call>{"name": "x", "arguments": NaN}</tool_call>',
    '<tool_call>{"name": "x", "arguments": {}, "name": "y"}</tool_call>',
    '<tool_call>  {"name": "x", "arguments": 1.0e5} </tool_call>', '<tool_call>{"name": "x", "arguments": {}} tail</tool_call>',
]


def test_hermes_parser_equals_verls():
    from plait.agents.tool_parser import parse_tool_calls
    env = {**os.environ, "PYTHONPATH": VERL_SITE, "VERL_LOGGING_LEVEL": "CRITICAL"}
    done = subprocess.run([sys.executable, "-c", PARSER_SIDE, json.dumps(TURNS)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    theirs = json.loads(lines[0][len("RESULT "):])
    ours = [[content, [[c.name, c.arguments] for c in calls]] for content, calls in map(parse_tool_calls, TURNS)]
    assert ours == theirs


GPT_OSS_SIDE = PARSER_SIDE.replace("HermesToolParser", "GptOssToolParser").replace(
    "    def decode(self, text):", "    pad_token = '<|endoftext|>'\n\n    def decode(self, text, **kwargs):")
_HEAD = "<|start|>assistant<|channel|>"
GPT_OSS_TURNS = [
    "<|channel|>final<|message|>42<|return|>",
    "<|channel|>analysis<|message|>think<|end|>" + _HEAD + "final<|message|>42<|return|>",
    _HEAD + 'commentary to=functions.add <|constrain|>json<|message|>{"a": 2,"b":3}<|call|>',
    "<|channel|>analysis<|message|>use add<|end|>" + _HEAD + 'commentary to=functions.add <|constrain|>json<|message|>'
    '{"a": 1}<|call|>',
    "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{}<|call|>",  # no head of its own
    _HEAD + "analysis<|message|>" + _HEAD + "commentary to=functions.x <|constrain|>json<|message|>{}<|call|><|end|>",
    _HEAD + "commentary to=functions.a <|constrain|>json<|message|>not json<|call|> mid " + _HEAD
    + "commentary to=functions.b.c <|constrain|>json<|message|>{\n\"k\": [1]\n}<|call|> tail",
    _HEAD + "commentary to=functions.cut <|constrain|>json<|message|>{\"a\": 1}",
    _HEAD + "commentary  to=functions.sp <|constrain|>json<|message|>{}<|call|>",
    _HEAD + "commentary to=functions.x<|constrain|>json<|message|>{}<|call|>",
]


def test_gpt_oss_parser_equals_verls():
    from plait.agents.tool_parser import parse_tool_calls
    env = {**os.environ, "PYTHONPATH": VERL_SITE, "VERL_LOGGING_LEVEL": "CRITICAL"}
    done = subprocess.run([sys.executable, "-c", GPT_OSS_SIDE, json.dumps(GPT_OSS_TURNS)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    theirs = json.loads(lines[0][len("RESULT "):])
    ours = [[content, [[c.name, c.arguments] for c in calls]]
            for content, calls in (parse_tool_calls(t, "gpt-oss") for t in GPT_OSS_TURNS)]
    assert ours == theirs


# -- interactions: verl 0.9.1 has none (no verl.interactions, no interaction_config_path); plait follows
# the loop of the verl the corpus was measured at (volcengine/verl b178a3c), checked here when a checkout
# of it is given: PLAIT_VERL_INTERACTION_SRC=<a folder holding that verl/ package> (with PLAIT_VERL_SITE
# for its dependencies).
INTERACTION_SRC = os.environ.get("PLAIT_VERL_INTERACTION_SRC")
INTERACTION_SIDE = '''
import asyncio, json, sys
import transformers
from omegaconf import OmegaConf
from transformers import AutoTokenizer
try:
    from transformers import AutoModelForVision2Seq  # noqa: F401
except ImportError:  # that verl predates transformers 5, which renamed it (on the lazy module's class: its
    type(transformers).AutoModelForVision2Seq = transformers.AutoModelForImageTextToText  # attributes get reset)
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.workers.rollout.replica import TokenOutput

spec = json.load(open(sys.argv[1]))
tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
eos = tok.convert_tokens_to_ids("<|im_end|>")
_render = tok.apply_chat_template


def render(*args, **kwargs):  # that verl reads ids where transformers 5 returns a BatchEncoding by default
    kwargs.setdefault("return_dict", False)
    return _render(*args, **kwargs)


tok.apply_chat_template = render
''' + SCRIPTED_SERVER + '''

async def one(cfg, row, i):
    loop = ToolAgentLoop(DictConfigWrap(cfg), Server(row["turns"]), tok, None, dataset_cls=None,
                         dataset_config=DictConfigWrap(OmegaConf.create({})))
    out = await loop.run({"temperature": 1.0}, raw_prompt=spec["messages"][i], extra_info=row["extra_info"])
    return {"prompt_ids": out.prompt_ids, "response_ids": out.response_ids, "response_mask": out.response_mask,
            "response_logprobs": out.response_logprobs, "num_turns": out.num_turns,
            "turn_scores": out.extra_fields["turn_scores"]}


results = []
for response_length, multi_turn in spec["configs"]:
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": spec["prompt_length"], "response_length": response_length, "full_determinism": False,
        "multi_turn": {**multi_turn, "format": "hermes", "tool_config_path": None,
                       "interaction_config_path": spec["interaction_config_path"]}}}})
    results.append([asyncio.run(one(cfg, row, i)) for i, row in enumerate(spec["rows"])])
print("RESULT " + json.dumps(results))
'''
INTERACTION_YAML = ('interaction:\n  - name: "gsm8k"\n    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
                    "    config: {}\n")
INTERACTION_ROWS = [  # the scripted assistant turns, and the row's interaction_kwargs
    {"turns": ["#### 5"], "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "5"}}},
    {"turns": ["#### 4", "hmm #### 6", "#### 5"], "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "5"}}},
    {"turns": ["I think 5", "#### 5"], "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "5"}}},
    {"turns": ["no", "still no", "nope", "x", "y", "z"], "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "7"}}},
    {"turns": ["a long wrong answer " * 6, "#### 5"], "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "5"}}},
]
INTERACTION_CONFIGS = [
    [400, {"max_user_turns": None, "max_assistant_turns": 4, "max_parallel_calls": 1, "max_tool_response_length": 256,
           "tool_response_truncate_side": "middle"}],
    [150, {"max_user_turns": 2, "max_assistant_turns": None, "max_parallel_calls": 1, "max_tool_response_length": 256,
           "tool_response_truncate_side": "middle"}],
]


@pytest.mark.skipif(not INTERACTION_SRC or not (Path(INTERACTION_SRC or ".") / "verl" / "interactions").is_dir(),
                    reason="a verl checkout with verl/interactions not given: set PLAIT_VERL_INTERACTION_SRC")
def test_plait_interaction_loop_equals_verls(setup):
    from types import SimpleNamespace

    from plait.agents.interactions import InteractionBox
    from plait.agents.tools import ToolLimits
    from plait.agents.worker import AgentWorker
    from plait.config import PlaitConfig, SamplingConfig
    from plait.models import load_tokenizer
    from plait.types import PromptBatch
    root, _ = setup
    (root / "interaction.yaml").write_text(INTERACTION_YAML)
    spec = root / "interaction_spec.json"
    spec.write_text(json.dumps({"tokenizer": str(root / "tokenizer"), "rows": INTERACTION_ROWS, "configs": INTERACTION_CONFIGS,
                                "prompt_length": PROMPT_LENGTH, "interaction_config_path": str(root / "interaction.yaml"),
                                "messages": [messages(i) for i in range(len(INTERACTION_ROWS))]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([INTERACTION_SRC, VERL_SITE]), "VERL_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, "-c", INTERACTION_SIDE, str(spec)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    theirs = json.loads(lines[0][len("RESULT "):])
    tok = load_tokenizer(root / "tokenizer")
    global ROWS
    saved, ROWS = ROWS, INTERACTION_ROWS  # the scripted engine reads its turns from ROWS
    ours = []
    try:
        for response_length, multi_turn in INTERACTION_CONFIGS:
            cfg = PlaitConfig()
            cfg.data.max_prompt_length, cfg.data.max_response_length = PROMPT_LENGTH, response_length
            for k, v in multi_turn.items():
                setattr(cfg.actor_rollout_ref.rollout.multi_turn, k, v)
            cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
            box = InteractionBox.from_config(SimpleNamespace(interaction_config_path=str(root / "interaction.yaml")),
                                             ToolLimits(num_workers=2))
            worker = AgentWorker(cfg, tok, "qwen2", None, box)
            n = len(INTERACTION_ROWS)
            prompts = PromptBatch(prompt_ids=[[1]] * n, data_sources=["t"] * n, ground_truths=["5"] * n,
                                  indices=list(range(n)), agent_names=[],
                                  extra_infos=[{"raw_prompt": messages(i), **r["extra_info"]} for i, r in enumerate(INTERACTION_ROWS)])
            try:
                batch = worker.generate(prompts, SamplingConfig(n=1), ScriptedEngine(tok), lambda: 0)
            finally:
                worker.close()
            ours.append([{**{k: v for k, v in row_of(batch, i).items() if k != "tool_rewards"},
                          "turn_scores": batch.extra_infos[i]["turn_scores"]} for i in range(n)])
    finally:
        ROWS = saved
    # That verl predates 0.9.1's ChatML rule (the "\n" after a sampled <|im_end|>, inserted with mask 0; plait
    # follows 0.9.1, as the tool parity above checks): drop it from ours, then compare; where the budget cut
    # the response, on the part both kept.
    newline, eos = tok.encode("\n", add_special_tokens=False)[0], tok.convert_tokens_to_ids("<|im_end|>")
    for config, (a, b) in enumerate(zip(ours, theirs)):
        for i, (x, y) in enumerate(zip(a, b)):
            ids, mask = x["response_ids"], x["response_mask"]
            keep = [k for k in range(len(ids)) if not (k and ids[k] == newline and mask[k] == 0 and ids[k - 1] == eos
                                                        and mask[k - 1] == 1)]
            x = {**x, **{key: [x[key][k] for k in keep] for key in ("response_ids", "response_mask", "response_logprobs")}}
            n = len(x["response_ids"]) if len(y["response_ids"]) < INTERACTION_CONFIGS[config][0] else len(keep)
            y = {**y, **{key: y[key][:n] for key in ("response_ids", "response_mask", "response_logprobs")}}
            assert x == y, (config, i, tok.decode(x["response_ids"]), tok.decode(y["response_ids"]),
                            {k: (x[k], y[k]) for k in x if x[k] != y[k] and k != "response_ids"})
