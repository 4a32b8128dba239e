"""The gateway's HTTP APIs driven by the clients users use: the `openai` and `anthropic` SDKs, on 127.0.0.1,
over a scripted engine (what the model says is scripted; everything between the SDK and the engine is real)."""

import json

import anthropic
import requests
import openai
import pytest

from gateway_helpers import CALL, served

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                          "b": {"type": "integer"}}}}}]


def test_openai_chat_tool_calls_logprobs_and_the_follow_up(tokenizer):
    with served(tokenizer) as (gateway, url, engine, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        messages = [{"role": "user", "content": "what is 2+3?"}]
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, logprobs=True)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert r.usage.completion_tokens == len(CALL) + 1  # the char model: a token a character, and EOS
        assert [t.logprob for t in r.choices[0].logprobs.content] == [-0.5] * (len(CALL) + 1)
        assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)["input_ids"])
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        assert r.choices[0].message.content == "#### 5" and r.choices[0].finish_reason == "stop"
        assert "<|tool|>5<|end|>" in engine.prompts[-1]
        assert [m.id for m in client.models.list()] == ["tiny"]


def test_openai_streaming_completions_and_n(tokenizer):
    with served(tokenizer, script=lambda text: "hello") as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello"
        assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 6
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3)
        assert [c.message.content for c in r.choices] == ["hello"] * 3 and r.usage.completion_tokens == 18
        c = client.completions.create(model="tiny", prompt="abc", max_tokens=3, logprobs=0)
        assert c.choices[0].text == "hel" and c.choices[0].finish_reason == "length"
        assert c.choices[0].logprobs.token_logprobs == [-0.5] * 3
        c = client.completions.create(model="tiny", prompt=[97, 98], max_tokens=20)
        assert c.choices[0].text == "hello" and c.usage.prompt_tokens == 2


def test_stop_strings_cut_the_answer_and_its_tokens(tokenizer):
    with served(tokenizer, script=lambda text: "Thought: add\nObservation: 5") as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           stop=["Observation:"])
        assert r.choices[0].message.content == "Thought: add\n" and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len("Thought: add\n")


def test_anthropic_messages_tool_use_and_streaming(tokenizer):
    with served(tokenizer) as (_, url, engine, _q):
        client = anthropic.Anthropic(base_url=url, api_key="none")
        tools = [{"name": "add", "description": "Add.", "input_schema": TOOLS[0]["function"]["parameters"]}]
        messages = [{"role": "user", "content": "what is 2+3?"}]
        m = client.messages.create(model="tiny", max_tokens=200, system="Be brief.", messages=messages, tools=tools)
        use = [b for b in m.content if b.type == "tool_use"][0]
        assert m.stop_reason == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
        assert engine.prompts[-1].startswith("<|system|>Be brief.<|end|>")
        messages += [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        with client.messages.stream(model="tiny", max_tokens=200, messages=messages, tools=tools) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "#### 5" and final.stop_reason == "end_turn" and final.usage.output_tokens == 7
        assert client.messages.count_tokens(model="tiny", messages=messages, tools=tools).input_tokens > 0


def test_wrong_requests_get_the_apis_errors(tokenizer):
    with served(tokenizer) as (_, url, _e, _q):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        hi = [{"role": "user", "content": "hi"}]
        cases = [(dict(messages=[]), "messages"), (dict(messages=hi, tool_choice="required", tools=TOOLS), "tool_choice"),
                 (dict(messages=hi, presence_penalty=0.5), "presence_penalty"),
                 (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
                 (dict(messages=hi, top_logprobs=3, logprobs=True), "top_logprobs"),
                 (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                  "messages[0].content")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", **kwargs)
            assert err.value.status_code == 400 and err.value.body["param"] == param, kwargs
        r = requests.post(url + "/v1/chat/completions", data=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError) as err:
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
                model="tiny", max_tokens=10, messages=[{"role": "system", "content": "x"}])
        assert err.value.body["error"]["type"] == "invalid_request_error" and "role" in err.value.message


def test_the_server_answers_keep_alive_clients_without_nagles_delay(tokenizer):
    """Accepted connections have TCP_NODELAY (inherited from the listening socket): without it every request of a
    keep-alive client (the openai SDK's) waited for the client's delayed ACK, ~40 ms on Linux."""
    import http.client
    import socket

    from plait.agents.runner import EventLoopThread
    from plait.serving.gateway import Gateway
    from plait.serving.server import Server
    thread = EventLoopThread()
    server = Server(Gateway(tokenizer, "qwen2", "hermes", [tokenizer.eos_token_id], "tiny"), thread.loop)
    try:
        conn = http.client.HTTPConnection(server.host, server.port)
        conn.request("GET", "/v1/models")  # keep-alive: the connection stays open
        assert conn.getresponse().read()
        sockets = [c.transport.get_extra_info("socket") for c in server.uvicorn.server_state.connections]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
        conn.close()
    finally:
        server.close()
        thread.close()


def test_sessions_by_path_and_by_key_and_their_reward(tokenizer):
    with served(tokenizer, plain=False) as (gateway, url, _e, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        for client in (openai.OpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="x"),
                       openai.OpenAI(base_url=url + "/v1", api_key=session.id)):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert len(session.spans) == 2 and len(session.trajectories()) == 2  # the same request twice: two samples
        r = requests.post(f"{url}/sessions/{session.id}/reward", json={"reward": 0.75})
        assert r.status_code == 200 and session.reward == 0.75
        assert requests.post(f"{url}/sessions/{session.id}/reward", json={"reward": "high"}).status_code == 400
        anonymous = openai.OpenAI(base_url=url + "/v1", api_key="not-a-session", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no open session"):
            anonymous.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_a_tool_call_the_parser_cannot_read_comes_back_as_text_and_is_counted(tokenizer):
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    with served(tokenizer, script=lambda text: "ok " + broken, plain=False) as (gateway, url, _e, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 400)
        openai_client = openai.OpenAI(base_url=url + "/v1", api_key=session.id)
        r = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS)
        assert r.choices[0].message.content == "ok " + broken and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        tools = [{"name": "add", "description": "Add.", "input_schema": TOOLS[0]["function"]["parameters"]}]
        m = anthropic.Anthropic(base_url=url, api_key=session.id).messages.create(
            model="tiny", max_tokens=200, messages=[{"role": "user", "content": "2+3?"}], tools=tools)
        assert [(b.type, b.text) for b in m.content] == [("text", "ok " + broken)] and m.stop_reason == "end_turn"
        assert session.unparsed == 2 and session.call_blocks == 2 and session.calls == 0
