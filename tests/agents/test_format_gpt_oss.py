"""multi_turn.format=gpt-oss through the tool_agent loop: a harmony-style chat template on the char-level
tokenizer, a scripted model that reasons, calls a real function tool (in its worker process) and
answers; the call is parsed out of the sampled text, the tool's answer is the template's suffix diff
(mask 0) and the sampled turns are kept as sampled. And the start check for formats plait does not
parse (verl stops its tool_agent loop at an unknown one)."""

import sys
from pathlib import Path

import pytest

from plait.agents.tokens import ContinuousTokens
from plait.agents.worker import AgentWorker, check_agent_names
from plait.config import PlaitConfig, SamplingConfig
from plait.configtree import ConfigError
from plait.models import build_char_tokenizer
from plait.types import PromptBatch

sys.path.insert(0, str(Path(__file__).parent))
from test_interaction import Engine  # noqa: E402  (the scripted engine, shared)
from test_loop import tools  # noqa: E402,F401  (the `add` tool box fixture, shared)

HARMONY = ("{% for m in messages %}"
           "{% if m['role'] == 'assistant' and m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
           "<|start|>assistant<|channel|>commentary to=functions.{{ c['function']['name'] }} <|constrain|>json<|message|>"
           "{{ c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
           "{% elif m['role'] == 'tool' %}<|start|>functions to=assistant<|channel|>commentary<|message|>{{ m['content'] }}<|end|>"
           "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
CALL = ('<|channel|>analysis<|message|>add them<|end|><|start|>assistant<|channel|>commentary to=functions.add '
        '<|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>')
ANSWER = "<|channel|>final<|message|>#### 5<|return|>"


def test_gpt_oss_turns_through_the_tool_agent_loop(tools):
    tok = build_char_tokenizer()
    tok.chat_template = HARMONY
    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 512, 400
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    cfg.actor_rollout_ref.rollout.multi_turn.format = "gpt-oss"
    batch = PromptBatch(prompt_ids=[[1]], data_sources=["t"], ground_truths=["5"], indices=[0], agent_names=[],
                        extra_infos=[{"raw_prompt": [{"role": "user", "content": "2+3?"}]}])
    worker = AgentWorker(cfg, tok, "gpt_oss", tools)
    try:
        out = worker.generate(batch, SamplingConfig(n=1), Engine(tok, lambda answers: CALL if answers < 0 else ANSWER,
                                                                  "to=assistant"),  # (tool answers so far) - 1
                              lambda: 0)
    finally:
        worker.thread.close()
    eos = tok.eos_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False) + [eos]  # noqa: E731
    tool = ContinuousTokens(tok, "gpt_oss").delta([{"role": "tool", "content": "5"}], None)
    assert tok.decode(tool) == "<|start|>functions to=assistant<|channel|>commentary<|message|>5<|end|><|start|>assistant"
    parts = [(enc(CALL), 1), (tool, 0), (enc(ANSWER), 1)]
    n = int(out.attended[0].sum())
    assert out.responses[0, :n].tolist() == [t for ids, _ in parts for t in ids]
    assert out.response_mask[0, :n].tolist() == [m for ids, m in parts for _ in ids]
    assert out.extra_infos[0]["tool_rewards"] == [0.5] and out.extra_infos[0]["num_turns"] == 4


@pytest.mark.parametrize("names, default, refused", [
    (set(), "tool_agent", True), ({"tool_agent"}, "single_turn_agent", True), (set(), "single_turn_agent", False)])
def test_a_format_plait_does_not_parse_is_refused_where_rows_run_tool_agent(names, default, refused):
    if not refused:  # verl reads the format only in tool_agent: single-turn rows run as in verl
        check_agent_names(None, default, names, "qwen")
        return
    with pytest.raises(ConfigError, match="one of hermes, gpt-oss: rows run tool_agent") as err:
        check_agent_names(None, default, names, "qwen")
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.format"
