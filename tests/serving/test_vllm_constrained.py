"""Forced tool calls and JSON answers on the vLLM engine (issue 55): `plait serve --engine vllm` honours them by vLLM's
structured outputs (guidance backend, plait's grammar as lark); vLLM's processed log-probs are over the grammar's
allowed set, so a training session's trainer log-probs with the replayed grammar mask equal the engine's, and a
request an abort cut resumes in its grammar (plait's vLLM plugin). One engine serves the module."""

import json

import jsonschema
import openai
import pytest
import torch
from transformers import Qwen2ForCausalLM

from plait.config import RolloutConfig
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
from plait.profiler.session import ProfilerSession
from plait.serving.protocol import ChatRequest, Constraint
from plait.serving.serve import ModelServer
from plait.workers.grammar import unpack
from plait.workers.rollout_engine import SamplingParams

pytest.importorskip("vllm")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.vllm

SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
ADD = {"type": "object", "properties": {"a": SMALL, "b": SMALL}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
ANSWER = {"type": "object", "properties": {"answer": SMALL, "ok": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
          "required": ["answer", "ok", "unit"], "additionalProperties": False}
ASK = [{"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def server(vllm_model_path):
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    s = ModelServer(vllm_model_path, RolloutConfig(name="vllm", dtype="float32", max_model_len=512), profiler,
                    name="tiny", max_tokens=200)
    yield s
    s.close()


@pytest.fixture(scope="module")
def model(vllm_model_path):
    return Qwen2ForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32)


def answer_grammar(server):
    return server.gateway.grammar(ChatRequest(messages=[], constraint=Constraint("response_format", json=ANSWER)))["grammar"]


def test_plait_serve_on_vllm_forces_calls_and_json_answers(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=3)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), ADD)
    r = client.chat.completions.create(model="tiny", messages=ASK, n=3, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), ANSWER)


def test_vllm_log_probs_are_over_the_replayed_grammars_allowed_set(server, model):
    """Each sampled token's vLLM log-prob is log_softmax(logits / T) over the set the grammar replayed over the sampled
    tokens allows (what the trainer takes); over the whole vocabulary it is not."""
    grammar, engine = answer_grammar(server), server.rollout.engine
    prompt = server.gateway.tokenizer.encode("2+3?")
    gen = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=60, temperature=0.7, grammar=grammar),
                          generator=torch.Generator().manual_seed(0))
    worst_masked, best_unmasked = 0.0, float("inf")
    for row in range(3):
        n = int(gen.response_mask[row].sum())
        ids = gen.responses[row, :n].tolist()
        assert gen.stop_reasons[row] == "eos" and ids[-1] in server.rollout.eos_ids
        jsonschema.validate(json.loads(server.gateway.tokenizer.decode(ids[:-1])), ANSWER)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float() / 0.7  # [n, vocab]
        allowed = unpack(grammar.replay(ids), grammar.vocab, logits.shape[-1])                         # [n, vocab]
        masked = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        full = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        worst_masked = max(worst_masked, float((masked - gen.logprobs[row, :n]).abs().max()))
        best_unmasked = min(best_unmasked, float((full - gen.logprobs[row, :n]).abs().max()))
    assert worst_masked <= 1e-4 and best_unmasked > 1e-2, (worst_masked, best_unmasked)


def test_a_constrained_request_cut_by_an_abort_resumes_in_its_grammar_on_vllm(server):
    """Grammar.after on vLLM: the resumed request's matcher starts after the tokens so far (plait's vLLM plugin), so
    the whole reply is one JSON object under the schema (a fresh matcher would start a second object)."""
    grammar = answer_grammar(server)
    tok = server.gateway.tokenizer
    prompt, head = tok.encode("2+3?"), tok.encode('{"answer": 4', add_special_tokens=False)
    gen = server.rollout.engine.generate([prompt + head] * 3, SamplingParams(max_new_tokens=60, grammar=grammar.after(head)),
                                         generator=torch.Generator().manual_seed(1))
    for row in range(3):
        ids = head + gen.responses[row, :int(gen.response_mask[row].sum())].tolist()
        assert ids[-1] in server.rollout.eos_ids
        grammar.replay(ids)
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), ANSWER)


def test_a_training_session_on_vllm_trains_the_constrained_distribution(server, model):
    """Through the gateway in a training session: the batch rows carry the replayed grammar masks and the trainer's
    log-probs over them equal vLLM's (float32); without the masks they do not."""
    from plait.agents.openai_agent import Outcome, session_output
    from plait.agents.worker import to_batch
    from plait.types import PromptBatch
    from plait.workers.actor import micro_forward
    gateway = server.gateway
    session = gateway.open("row 0", server.queue.generate, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, 256, 200)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=session.id, max_retries=0)
    try:
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=2)
        assert all(c.finish_reason == "tool_calls" for c in r.choices), r
        r = client.chat.completions.create(model="tiny", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    finally:
        gateway.close(session.id)
    out = session_output(session, Outcome(score=1.0), gateway.ct, ASK, 256, 200, "test", session.grammar_masks(200))
    prompts = PromptBatch(prompt_ids=[gateway.tokenizer.encode("2+3?")], data_sources=["t"], ground_truths=["5"],
                          extra_infos=[{}], indices=[0])
    batch = to_batch([out], prompts, 1, gateway.tokenizer.pad_token_id, 0, 200)
    mask = batch.response_mask.bool()
    assert sum(len(g["cols"]) for g in batch.grammar_masks) > 20
    with torch.no_grad():
        trained = micro_forward(model, batch, 1.0, False)[0]
        unmasked = micro_forward(model, batch.replace(grammar_masks=None), 1.0, False)[0]
    assert (trained - batch.rollout_logprobs)[mask].abs().max() <= 1e-4
    assert (unmasked - batch.rollout_logprobs)[mask].abs().max() > 1e-2
