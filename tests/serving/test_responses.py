"""OpenAI's Responses API (`/v1/responses`) driven by the clients that call it: the `openai` SDK's `responses.create`
and `responses.stream`, and OpenAI's Agents SDK with its default model (OpenAIResponsesModel), on 127.0.0.1 over the
scripted engine (what the model says is scripted; everything between the SDK and the engine is real) and over
`plait serve` on a tiny model. Inside a session the trained tokens are the sampled ones, laid out exactly as the same
conversation through chat completions lays them out."""

import asyncio
import json
import threading

import openai
import pytest
import requests

from gateway_helpers import CALL, served
from plait.agents.tokens import ContinuousTokens

TOOLS = [{"type": "function", "name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def test_text_a_function_call_and_its_output(tokenizer):
    with served(tokenizer) as (_, url, engine, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.responses.create(model="tiny", input="what is 2+3?", instructions="Be brief.", tools=TOOLS)
        [call] = r.output
        assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
        assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
        assert call.call_id.startswith("call_") and r.output_text == ""
        assert engine.prompts[-1] == "<|system|>Be brief.<|end|>\n<|user|>what is 2+3?<|end|>\n<|assistant|>"
        assert r.usage.output_tokens == len(CALL) + 1 and r.usage.input_tokens == len(engine.prompts[-1])
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        follow = [{"role": "user", "content": "what is 2+3?"}, *[o.model_dump(exclude_none=True) for o in r.output],
                  {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        r = client.responses.create(model="tiny", input=follow, instructions="Be brief.", tools=TOOLS)
        assert r.output_text == "#### 5" and r.output[0].type == "message" and r.output[0].role == "assistant"
        assert engine.prompts[-1].endswith("<|assistant|>[call add]<|end|>\n<|tool|>5<|end|>\n<|assistant|>")
        r = client.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_text",
                                                                                       "text": "hi"}]}], max_output_tokens=3)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3
        r = client.responses.create(model="tiny", input="hi", include=["message.output_text.logprobs"])
        assert [t.logprob for t in r.output[0].content[0].logprobs] == [-0.5] * (len(CALL) + 1)


def test_previous_response_id_continues_the_conversation(tokenizer):
    with served(tokenizer) as (_, url, engine, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="tiny", input="what is 2+3?", instructions="Be brief.", tools=TOOLS)
        r = client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS, input=[
            {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "5"}])
        assert r.output_text == "#### 5" and r.previous_response_id == first.id
        # the instructions are not carried over (as OpenAI does); the conversation is
        assert engine.prompts[-1] == ("<|user|>what is 2+3?<|end|>\n<|assistant|>[call add]<|end|>\n<|tool|>5<|end|>\n"
                                      "<|assistant|>")
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model="tiny", previous_response_id="resp_nowhere", input="hi")
        assert err.value.body["param"] == "previous_response_id" and err.value.body["code"] == "previous_response_not_found"


def test_the_sdks_stream_helper_and_stream_true(tokenizer):
    with served(tokenizer, script=lambda text: "hello") as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        with client.responses.stream(model="tiny", input="hi") as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(9))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello"
        assert final.output_text == "hello" and final.usage.output_tokens == 6 and final.status == "completed"
        raw = list(client.responses.create(model="tiny", input="hi", stream=True))
        assert raw[-1].type == "response.completed" and raw[-1].response.output_text == "hello"
    with served(tokenizer) as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        with client.responses.stream(model="tiny", input="what is 2+3?", tools=TOOLS) as stream:
            kinds = [e.type for e in stream]
            [call] = stream.get_final_response().output
        assert "response.function_call_arguments.done" in kinds and call.name == "add"
        assert json.loads(call.arguments) == {"a": 2, "b": 3}


def test_what_plait_cannot_honour_is_a_400_naming_the_field(tokenizer):
    with served(tokenizer) as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        cases = [(dict(tool_choice="required", tools=TOOLS), "tool_choice"),
                 (dict(text={"format": {"type": "json_object"}}), "text.format"),
                 (dict(tools=[{"type": "web_search"}]), "tools[0]"),
                 (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content"),
                 (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0]"),
                 (dict(reasoning={"effort": "high"}), "reasoning"), (dict(truncation="auto"), "truncation"),
                 (dict(top_logprobs=3), "top_logprobs"), (dict(max_output_tokens=0), "max_output_tokens"),
                 (dict(background=True), "background"), (dict(input=[]), "input")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="tiny", **{"input": "hi", **kwargs})
            assert err.value.status_code == 400 and err.value.body["param"] == param, kwargs
        r = requests.post(url + "/v1/responses", data=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        # what asks nothing plait cannot do is accepted (openai-agents' defaults)
        r = client.responses.create(model="tiny", input="hi", reasoning={"effort": "none"}, text={"verbosity": "low"},
                                    include=[], store=False, parallel_tool_calls=False, truncation="disabled")
        assert r.status == "completed"


def trajectory_by_chat(tokenizer, gateway, url, queue):
    """The session the same conversation makes through chat completions."""
    session = gateway.open("row 1", queue.generate, {"temperature": 1.0}, 256, 200)
    client = openai.OpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="x")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 2+3?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"}]
    client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS)
    [t] = session.trajectories()
    return t, messages


def test_a_session_on_responses_trains_the_sampled_tokens_as_chat_completions_lays_them_out(tokenizer):
    """previous_response_id inside a session extends one chain: the trajectory is token for token the one the
    same conversation makes through chat completions; the sampled turns are trained (mask 1, their log-probs)."""
    with served(tokenizer, plain=False) as (gateway, url, _e, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        client = openai.OpenAI(base_url=url + "/v1", api_key=session.id)  # the session named by the key
        first = client.responses.create(model="tiny", input="what is 2+3?", instructions="Be brief.", tools=TOOLS)
        r = client.responses.create(model="tiny", previous_response_id=first.id, instructions="Be brief.", tools=TOOLS,
                                    input=[{"type": "function_call_output", "call_id": first.output[0].call_id, "output": "5"}])
        assert r.output_text == "#### 5" and len(session.spans) == 2
        [t] = session.trajectories()
        by_chat, messages = trajectory_by_chat(tokenizer, gateway, url, queue)
    assert (t.ids, t.mask, t.logprobs) == (by_chat.ids, by_chat.mask, by_chat.logprobs)
    ct = ContinuousTokens(tokenizer, "qwen2")
    turn1 = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn2 = tokenizer.encode("#### 5", add_special_tokens=False) + [tokenizer.eos_token_id]
    tool = ct.delta(messages[3:], CHAT_TOOLS)
    assert t.ids == ct.render(messages[:2], True, CHAT_TOOLS) + turn1 + tool + turn2
    assert t.mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert t.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)


def add_tool(calls):
    from agents import function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b
    return add


def test_openai_agents_default_model_runs_and_streams(tokenizer):
    """An Agent as its docs write it: the default model type (OpenAIResponsesModel) on a client set with
    set_default_openai_client; its function tool is called and its answer read, with Runner.run and run_streamed."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    async def run(url):
        agents.set_default_openai_client(openai.AsyncOpenAI(base_url=url + "/v1", api_key="none"), use_for_tracing=False)
        agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[add_tool(calls)])
        result = await agents.Runner.run(agent, "what is 2+3?")
        streamed = agents.Runner.run_streamed(agent, "what is 2+3?")
        kinds = {e.type async for e in streamed.stream_events()}
        return result, streamed, kinds
    try:
        with served(tokenizer) as (_, url, engine, _q):
            result, streamed, kinds = asyncio.run(run(url))
    finally:
        agents.set_default_openai_client(None, use_for_tracing=False)
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)  # the Responses API answered them
    assert result.final_output == "#### 5" == streamed.final_output and calls == [(2, 3), (2, 3)]
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert "raw_response_event" in kinds and engine.prompts[-1].startswith("<|system|>Use the tool.<|end|>")


@pytest.mark.parametrize("chained", [False, True])
def test_openai_agents_in_a_session_trains_the_sampled_tokens(tokenizer, chained):
    """openai-agents on its default Responses model, the session named by the API key (as the gateway hands the
    function form its key): whether it re-sends the whole input each turn or chains responses by
    previous_response_id (auto_previous_response_id), the session keeps one chain whose trained tokens are exactly
    what was sampled."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    with served(tokenizer, plain=False) as (gateway, url, _e, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        model = agents.OpenAIResponsesModel("plait", openai.AsyncOpenAI(base_url=url + "/v1", api_key=session.id))
        agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[add_tool([])], model=model)
        result = agents.Runner.run_sync(agent, "what is 2+3?", auto_previous_response_id=chained)
        assert result.final_output == "#### 5"
    [t] = session.trajectories()
    turn1 = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn2 = tokenizer.encode("#### 5", add_special_tokens=False) + [tokenizer.eos_token_id]
    sampled = [i for i, m in zip(t.ids[-len(t.mask):], t.mask) if m]
    assert sampled == turn1 + turn2 and len(session.spans) == 2 and session.calls == 1


def test_openai_agents_completes_a_run_against_plait_serve(tmp_path):
    """`plait serve` (its serve function, on a free port) over a tiny random model, with the hf engine: an Agent on
    its default model type with a function tool runs to its final output. A seed (sent through extra_body) makes
    the random model's answer one that ends with EOS inside the budget."""
    agents = pytest.importorskip("agents")
    from plait.models import create_tiny_model
    from plait.serving.serve import serve
    agents.set_tracing_disabled(True)
    path = create_tiny_model(tmp_path / "m", size="xs", seed=5)
    urls, stop = [], threading.Event()
    server = threading.Thread(target=serve, args=(path,), kwargs=dict(port=0, max_tokens=512, ready=urls.append,
                                                                     stop=stop), daemon=True)
    server.start()
    try:
        while not urls and server.is_alive():
            server.join(0.05)
        assert urls, "plait serve did not start"
        model = agents.OpenAIResponsesModel("tiny", openai.AsyncOpenAI(base_url=urls[0] + "/v1", api_key="none"))
        agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[add_tool([])], model=model,
                             model_settings=agents.ModelSettings(extra_body={"seed": 1}))
        result = agents.Runner.run_sync(agent, "what is 2+3?")
    finally:
        stop.set()
        server.join(30)
    [response] = result.raw_responses
    assert isinstance(result.final_output, str) and 0 < response.usage.output_tokens < 512
    assert response.usage.input_tokens > len("Use the tool.what is 2+3?")
