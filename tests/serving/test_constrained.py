"""Forced tool calls and JSON answers (issue 55): `plait serve` (ModelServer over a random tiny model) honours OpenAI's
tool_choice "required" / a named function and response_format json_object / json_schema, the Responses API's and
Anthropic's forms, by grammar-constrained decoding (plait/workers/grammar.py), asked through the real SDKs; the
engine's log-probs are under the grammar's allowed set, and in a training session the trainer's are too (the
grammar replayed over the sampled tokens), a resumed request going on in its grammar."""

import asyncio
import json
import pickle
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

from plait.config import RolloutConfig
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
from plait.profiler.session import ProfilerSession
from plait.serving.protocol import ChatRequest, Constraint
from plait.serving.serve import ModelServer

pytest.importorskip("llguidance")

SMALL = {"type": "integer", "minimum": 0, "maximum": 99}  # bounded: a random model's numbers end
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
             "type": "object", "properties": {"a": SMALL, "b": SMALL}, "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "greet", "parameters": {
             "type": "object", "properties": {"word": {"enum": ["hi", "yo"]}, "loud": {"type": "boolean"}},
             "required": ["word", "loud"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "move", "parameters": {  # pydantic's shape: a nested model in $defs
             "$defs": {"Point": {"type": "object", "properties": {"x": SMALL, "y": SMALL}, "required": ["x", "y"],
                                 "additionalProperties": False}},
             "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
             "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"answer": SMALL, "ok": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
          "required": ["answer", "ok", "unit"], "additionalProperties": False}
ASK = [{"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from plait.models import create_tiny_model
    path = create_tiny_model(tmp_path_factory.mktemp("constrained") / "m", size="xs", seed=5)
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    s = ModelServer(path, RolloutConfig(name="hf"), profiler, name="tiny", max_tokens=200)
    yield s
    s.close()


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_openai_forced_calls_and_json_answers(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=4)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
    for name in ("greet", "move"):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, n=3,
                                           tool_choice={"type": "function", "function": {"name": name}})
        assert [c.message.tool_calls[0].function.name for c in r.choices] == [name] * 3
        for c in r.choices:
            check_call(name, c.message.tool_calls[0].function.arguments)
    # json_schema with tools offered (auto): the answer is the JSON or a call, never free text
    for tools in ({}, {"tools": TOOLS}):
        r = client.chat.completions.create(model="tiny", messages=ASK, n=4, **tools, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
        for c in r.choices:
            if c.message.tool_calls:
                check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
            else:
                assert c.finish_reason == "stop", c
                jsonschema.validate(json.loads(c.message.content), ANSWER)
    r = client.chat.completions.create(model="tiny", messages=ASK, n=4, seed=3, response_format={"type": "json_object"})
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(c.message.content), dict) for c in finished)
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", stream=True)
    calls = [d.function for chunk in stream for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices]
    assert len(calls) == 1
    check_call(calls[0].name, calls[0].arguments)


def test_responses_api_and_anthropic_forced_calls_and_json(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = client.responses.create(model="tiny", input="2+3?", tools=tools, tool_choice={"type": "function", "name": "add"})
    [call] = r.output
    assert call.type == "function_call" and call.name == "add"
    check_call("add", call.arguments)
    r = client.responses.create(model="tiny", input="2+3?", tools=tools, tool_choice="required")
    assert [o.type for o in r.output] == ["function_call"]
    r = client.responses.create(model="tiny", input="2+3?", text={"format": {"type": "json_schema", "name": "answer",
                                                                             "schema": ANSWER, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text.format.type == "json_schema"
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    atools = [{"name": n, "input_schema": p} for n, p in PARAMS.items()]
    for choice, names in (({"type": "any"}, set(PARAMS)), ({"type": "tool", "name": "greet"}, {"greet"})):
        for _ in range(2):
            m = claude.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=atools, tool_choice=choice)
            [use] = m.content
            assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name in names, m
            jsonschema.validate(use.input, PARAMS[use.name])


def test_what_cannot_be_forced_is_a_400_naming_the_field(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    lookbehind = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    cases = [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "add, greet, move"),
             (dict(tool_choice="required"), "tool_choice", "offered are: none"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": lookbehind}}),
              "response_format", "cannot be compiled")]
    for kwargs, param, said in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=ASK, **kwargs)
        assert err.value.body["param"] == param and said in err.value.body["message"], (kwargs, err.value.body)
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
            model="tiny", max_tokens=10, messages=ASK, tool_choice={"type": "tool"},
            tools=[{"name": "add", "input_schema": PARAMS["add"]}])
    assert "tool_choice" in err.value.message


def train_rows(server, session, prompt: str):
    """The session's chains as the batch rows plait trains on (their grammar masks replayed), and their rollout
    log-probs against the trainer's, with and without the masks: (rows, mask, trainer's, unmasked trainer's)."""
    from plait.agents.openai_agent import Outcome, session_output
    from plait.agents.worker import to_batch
    from plait.types import PromptBatch
    from plait.workers.actor import micro_forward
    out = session_output(session, Outcome(score=1.0), server.gateway.ct, ASK, 256, 200, "test", session.grammar_masks(200))
    prompts = PromptBatch(prompt_ids=[server.gateway.tokenizer.encode(prompt)], data_sources=["t"], ground_truths=["5"],
                          extra_infos=[{}], indices=[0])
    batch = to_batch([out], prompts, 1, server.gateway.tokenizer.pad_token_id, 0, 200)
    model = server.rollout.engine.model
    with torch.no_grad():
        trained = micro_forward(model, batch, 1.0, False)[0]
        unmasked = micro_forward(model, batch.replace(grammar_masks=None), 1.0, False)[0]
    return batch, batch.response_mask.bool(), trained, unmasked


def test_a_training_session_samples_under_the_grammar_and_trains_its_distribution(server):
    """In a training session a forced call and a JSON answer are sampled under their grammar; the session records
    which reply tokens were, the batch rows carry the replayed allowed sets, and the trainer's log-probs over them are
    the engine's (float32); over the whole vocabulary they are not."""
    gateway = server.gateway
    session = gateway.open("row 0", server.queue.generate, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, 256, 200)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=session.id, max_retries=0)
    try:
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=2)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
        r = client.chat.completions.create(model="tiny", messages=ASK + [{"role": "assistant", "content": "hm"},
                                                                        {"role": "user", "content": "as JSON"}],
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": ANSWER, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    finally:
        gateway.close(session.id)
    chains = session.trajectories()
    assert len(chains) == 3 and all(len(t.grammars) == 1 for t in chains)
    batch, mask, trained, unmasked = train_rows(server, session, "2+3?")
    constrained = sum(len(g["cols"]) for g in batch.grammar_masks)
    assert constrained == sum(end - start for t in chains for start, end, _ in t.grammars) > 20
    assert (trained - batch.rollout_logprobs)[mask].abs().max() <= 1e-5
    assert (unmasked - batch.rollout_logprobs)[mask].abs().max() > 1e-2  # the test can fail: the mask matters
    # the masks travel as a batch does: pickled (Ray), joined with unconstrained rows, split and selected
    from plait.types import RolloutBatch
    from plait.workers.actor import micro_forward
    joined = RolloutBatch.concat([batch.replace(grammar_masks=None), pickle.loads(pickle.dumps(batch))])
    assert joined.grammar_masks[:len(batch)] == [{}] * len(batch)
    rows = joined.split(2)[1].select(list(range(len(batch))))
    with torch.no_grad():
        assert torch.equal(micro_forward(server.rollout.engine.model, rows, 1.0, False)[0][mask], trained[mask])


def test_an_engine_without_grammars_refuses_a_sessions_constraint_in_one_line(tokenizer):
    """An engine whose table row takes no grammar (sglang's): a training session's forced call or JSON answer is a
    400 naming the field and why."""
    from gateway_helpers import served
    from plait.serving.gateway import grammars_for
    from plait.workers.engine import ENGINES
    grammars, why = grammars_for("sglang", tokenizer, [tokenizer.eos_token_id])
    assert grammars is None and why == ENGINES["sglang"].grammar == "the rollout engine takes no decoding grammar"
    assert grammars_for("vllm", tokenizer, [tokenizer.eos_token_id])[0] is not None  # vLLM's structured outputs
    with served(tokenizer, plain=False) as (gateway, url, _e, queue):
        gateway.no_grammar = why
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        client = openai.OpenAI(base_url=url + "/v1", api_key=session.id, max_retries=0)
        for kwargs, param in ((dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
                              (dict(response_format={"type": "json_object"}), "response_format")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=ASK, **kwargs)
            message = err.value.body["message"]
            assert err.value.body["param"] == param and "needs grammar-constrained decoding" in message and why in message
        assert not session.trajectories()


def test_a_sampled_token_its_grammar_does_not_allow_fails_the_session(server):
    """A replayed matcher that rejects a sampled token fails the session loudly (never trained silently)."""
    from plait.agents.openai_agent import Outcome, session_output
    grammar = server.gateway.grammar(ChatRequest(messages=[], constraint=Constraint("response_format", json=ANSWER)))["grammar"]
    session = server.gateway.open("row 0", server.queue.generate, {"temperature": 1.0}, 256, 200)
    ctx = session.context(ASK, None)
    bad = server.gateway.tokenizer.encode("x{}", add_special_tokens=False)  # no JSON object starts with x
    session.add_reply(ctx, (), bad, [-1.0] * len(bad), [0] * len(bad), grammar)
    with pytest.raises(ValueError, match=r"sampled token 0 of 3 \(id \d+\) is not one its decoding grammar allows"):
        session.grammar_masks(200)
    try:
        session.grammar_masks(200)
    except ValueError as err:
        out = session_output(session, Outcome(score=1.0), server.gateway.ct, ASK, 256, 200, "agent x (row 0)", err)
    info = out.extra_fields["session"]
    assert "sampled off its decoding grammar" in info["failure"] and sum(out.response_mask) == 0
    assert info["failed_after_cut"] is None and info["constrained_tokens"] == 0
    server.gateway.close(session.id)


def test_a_constrained_request_cut_by_an_abort_goes_on_in_its_grammar(server):
    """Partial rollout: a request an abort cut resumes from the matcher after its tokens so far (a fresh matcher
    there would write a second JSON object inside the first)."""
    from plait.agents.runner import Request, run_round
    grammar = server.gateway.grammar(ChatRequest(messages=[], constraint=Constraint("response_format", json=ANSWER)))["grammar"]
    prompt = server.gateway.tokenizer.encode("2+3?")
    head = server.gateway.tokenizer.encode('{"answer": 4', add_special_tokens=False)
    loop = asyncio.new_event_loop()
    requests = [Request(list(prompt), 60, {"temperature": 1.0, "grammar": grammar}, loop.create_future(), loop,
                        tokens=list(head), logprobs=[-1.0] * len(head), versions=[0] * len(head)) for _ in range(3)]
    with server.rollout._lock:  # (the server's own rounds wait: it has no requests of its own now)
        assert not run_round(requests, server.rollout._round(seed=7), 1)
    for r in requests:
        assert r.tokens[:len(head)] == head and r.tokens[-1] in server.rollout.eos_ids
        grammar.replay(r.tokens)  # every token, the resumed ones too, is one the grammar allows
        jsonschema.validate(json.loads(server.gateway.tokenizer.decode(r.tokens[:-1])), ANSWER)
    loop.close()


def test_the_engine_samples_and_scores_over_the_allowed_set(server):
    """Each token is one the grammar allows, and its log-prob is log_softmax over the allowed set, recomputed here by
    replaying the grammar over the sampled tokens and one forward pass (what a trainer would have to do)."""
    from plait.workers.rollout_engine import SamplingParams
    gateway, engine = server.gateway, server.rollout.engine
    grammar = gateway.grammar(ChatRequest(messages=[], constraint=Constraint("response_format", json=ANSWER)))["grammar"]
    prompt = gateway.tokenizer.encode("2+3?")
    gen = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=60, grammar=grammar),
                          generator=torch.Generator().manual_seed(0))
    for row in range(3):
        n = int(gen.response_mask[row].sum())
        ids = gen.responses[row, :n].tolist()
        matcher, masks = grammar.matcher(), []
        for t in ids:
            masks.append(grammar.allowed([matcher], engine.model.config.vocab_size)[0])
            assert matcher.consume_token(t), (row, ids)
        assert ids[-1] in server.rollout.eos_ids and matcher.is_stopped()
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()  # [n, vocab]
        logp = logits.masked_fill(~torch.stack(masks), float("-inf")).log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(gen.logprobs[row, :n], expected, atol=1e-5), (gen.logprobs[row, :n] - expected).abs().max()


class Verdict(BaseModel):  # an agent's structured output: bounded fields, so a random model's answer ends
    ok: bool
    unit: Literal["m", "s"]


def test_openai_agents_output_type_on_plait_serve(server):
    """openai-agents' default model on the Responses API: output_type sends text.format json_schema."""
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    agent = Agent(name="judge", instructions="Answer.", model=OpenAIResponsesModel("tiny", client), output_type=Verdict)

    async def twice():  # one loop: the client's connections belong to it
        return [(await Runner.run(agent, "2+3?")).final_output for _ in range(2)]
    assert all(isinstance(out, Verdict) for out in asyncio.run(twice()))


def test_pydantic_ai_output_type_on_plait_serve(server):
    """pydantic-ai's output_type (a forced call of its output tool) on chat completions and the Responses API."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    for model in (OpenAIChatModel, OpenAIResponsesModel):
        provider = OpenAIProvider(base_url=server.url + "/v1", api_key="none")
        agent = pydantic_ai.Agent(model("tiny", provider=provider), output_type=Verdict)
        assert isinstance(agent.run_sync("2+3?").output, Verdict)
