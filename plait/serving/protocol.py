"""OpenAI's and Anthropic's HTTP APIs in and out: request bodies to one `ChatRequest`, results to the
APIs' response bodies and server-sent events. Pure functions over dicts; no engine, no server.

In: OpenAI Chat Completions (`messages`, `tools`, `tool_choice`, `n`, `temperature`, `top_p`,
`max_tokens` / `max_completion_tokens`, `stop`, `seed`, `logprobs`, `top_logprobs=0`, `stream`,
`stream_options.include_usage`), OpenAI Completions (`prompt` as text or token ids), Anthropic
Messages (`system`, text / tool_use / tool_result blocks, `tools`, `tool_choice`, `stop_sequences`,
`stream`) and SGLang's token-level `/generate` (`input_ids` or `text`, `sampling_params`: what verl's
reward router answers a GenRM reward function's `generate` with). Both chats become chat-template messages (role, content as text, `tool_calls` with their
arguments as objects, `tool_call_id`): what `apply_chat_template` and plait's Continuous-Token builder
read. A forced tool choice (OpenAI's "required" or a named function, Anthropic's any or a named tool) and OpenAI's
`response_format` json_object / json_schema become a `Constraint` (JSON schemas) that the gateway samples under
(grammar-constrained decoding, plait/workers/grammar.py). A field that would change what is sampled and that plait
cannot honour (`presence_penalty`, `logit_bias`, images, `top_logprobs` > 0) is refused with the
API's own error shape and status (400), naming the field; fields that change nothing sampled
(`user`, `metadata`, `store`, ...) are accepted. A `seed` samples the request alone with its own
generator (outside sessions), so the same request with the same seed gets the same answer. Out: the APIs' bodies, with tool calls read
from the model's text by plait's tool parsers (multi_turn.format). The Responses API is translated into a chat
call by plait/serving/responses.py.

Left out: audio, images, `n` > 1 with streaming, true token-by-token streaming (an
engine answers a request when it finishes, so a stream carries the whole answer at once).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

# The function form's worker tags each call to the gateway with the session of the agent that made it
# (plait/agents/agent_process.py): the gateway trains the call there, whatever key or path the client carries.
SESSION_HEADER = "x-plait-session"


class ApiError(Exception):
    """A request the API answers with an error body: `status`, the message, its type and the field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error"}.get(self.status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


@dataclass
class ChatRequest:
    """One chat call, whichever API it came in."""
    messages: list[dict]                 # chat-template messages
    tools: Optional[list[dict]] = None   # OpenAI function schemas ({"type": "function", "function": {...}})
    parse_tools: bool = True             # tool_choice none: calls stay in the text
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None           # its own generator: the same request and seed, the same answer
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    constraint: Optional[Constraint] = None  # what the answer must be (a forced call, JSON): grammar-constrained


@dataclass
class Constraint:
    """A forced tool call or a JSON answer, as JSON schemas; the gateway compiles it (plait/workers/grammar.py)."""
    field: str                   # the request field that asks it (named where it is refused)
    json: Optional[dict] = None  # the answer is JSON valid under this schema ...
    call: Optional[dict] = None  # ... or one tool call whose {"name", "arguments"} is valid under this one


@dataclass
class Choice:
    """One sampled answer, ready to be written in either API."""
    token_ids: list[int]
    logprobs: list[float]
    content: str                          # the text less tool-call blocks (and the stop string)
    calls: list[tuple[str, str]]          # (name, arguments as JSON text)
    finish: str                           # stop | length | tool_calls
    stop_string: Optional[str] = None     # the stop sequence that ended it
    token_texts: list[str] = field(default_factory=list)
    call_blocks: int = 0                  # tool-call blocks the model wrote (parsed or not)


# -- requests ------------------------------------------------------------------------------------

REFUSED = {  # fields that change what is sampled, with the value that changes nothing
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
    "min_p": 0, "best_of": 1, "suffix": None, "echo": False, "prediction": None, "audio": None,
    "modalities": None, "reasoning_effort": None, "web_search_options": None,
}



def _typed(body: dict, key: str, kinds, check=None, why: str = "") -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"'{key}' must be {why or kinds}, got {value!r}", key)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise ApiError(400, f"'{key}' must be {why or kinds}, got {str(value)[:80]!r}", key)
    return value


def _sampling(body: dict, into: ChatRequest, max_keys: tuple[str, ...]) -> None:
    into.model = str(body.get("model") or "")
    into.n = _typed(body, "n", int, lambda v: 1 <= v <= 16, "an integer from 1 to 16") or 1
    into.temperature = _typed(body, "temperature", (int, float), lambda v: 0 <= v <= 2, "a number from 0 to 2")
    into.top_p = _typed(body, "top_p", (int, float), lambda v: 0 < v <= 1, "a number in (0, 1]")
    into.top_k = _typed(body, "top_k", int, lambda v: v >= -1, "an integer >= -1")
    into.seed = _typed(body, "seed", int, lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1")
    for key in max_keys:
        value = _typed(body, key, int, lambda v: v >= 1, "an integer >= 1")
        into.max_tokens = value if value is not None else into.max_tokens
    stop = body.get("stop", body.get("stop_sequences"))
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to 16 of them, got {str(stop)[:80]!r}", "stop")
    into.stop = stops
    into.stream = bool(_typed(body, "stream", bool) or False)
    for key, neutral in REFUSED.items():
        if key in body and body[key] not in (neutral, None):
            raise ApiError(400, f"'{key}'={str(body[key])[:60]} is not supported by this server: it would change what "
                                "is sampled and plait's engines do not implement it", key)


def chat_request(body: Any) -> ChatRequest:
    """An OpenAI Chat Completions body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    req = ChatRequest(messages=[])
    _sampling(body, req, ("max_tokens", "max_completion_tokens"))
    req.logprobs = bool(_typed(body, "logprobs", bool) or False)
    top = _typed(body, "top_logprobs", int, lambda v: 0 <= v <= 20, "an integer from 0 to 20")
    if top:
        raise ApiError(400, "'top_logprobs' > 0 is not supported: the engines return the sampled token's log-prob only",
                       "top_logprobs")
    options = _typed(body, "stream_options", dict) or {}
    req.include_usage = bool(options.get("include_usage"))
    if req.stream and req.n > 1:
        raise ApiError(400, "'n' > 1 with 'stream' is not supported", "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages")
    req.messages = [_openai_message(m, i) for i, m in enumerate(messages)]
    req.tools = _openai_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice not in ("auto", "none", "required", None) and not isinstance(name, str):
        raise ApiError(400, f"tool_choice {str(choice)[:80]!r} is not supported: use 'auto', 'none', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    req.parse_tools = choice != "none" and req.tools is not None
    req.constraint = constrain(req, choice == "required" or name is not None, name,
                               _typed(body, "response_format", dict), "response_format")
    return req


def constrain(req: ChatRequest, forced: bool, name: Optional[str], fmt: Optional[dict], fmt_field: str,
              tool_field: str = "tool_choice") -> Optional[Constraint]:
    """A request's constraint: a forced call (to `name`, or to any tool), else a JSON `fmt` (OpenAI's response_format
    or the Responses API's text.format: json_object, or json_schema with its schema) with any offered tool call
    allowed beside it; None where the answer is free."""
    if forced:
        return Constraint(tool_field, call=_call_schema(req.tools, name, tool_field))
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    holder = fmt.get("json_schema") if fmt_field == "response_format" else fmt  # the Responses API: flat
    schema = {"type": "object"} if kind == "json_object" else holder.get("schema") if isinstance(holder, dict) else None
    if kind not in ("json_object", "json_schema") or not isinstance(schema, dict):
        raise ApiError(400, f"{fmt_field} {str(fmt)[:80]} is not supported: use type 'text', 'json_object' or "
                            "'json_schema' with a 'schema' object", fmt_field)
    return Constraint(fmt_field, json=schema, call=_call_schema(req.tools, None, tool_field) if req.parse_tools else None)


def _call_schema(tools: Optional[list[dict]], name: Optional[str], field: str) -> dict:
    """The JSON schema of one call to `name` (None: to any of `tools`) as the tool parsers read it."""
    fns = [t["function"] for t in tools or [] if name is None or t["function"]["name"] == name]
    if not fns:
        offered = ", ".join(t["function"]["name"] for t in tools or []) or "none"
        raise ApiError(400, f"{field} forces a call to {name or 'a tool'}, and the tools offered are: {offered}", field)
    params = [f.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False} for f in fns]
    if not all(isinstance(p, dict) for p in params):
        raise ApiError(400, f"{field} forces a call, and a forced tool's 'parameters' must be a JSON schema object", "tools")
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": p},
              "required": ["name", "arguments"], "additionalProperties": False} for f, p in zip(fns, params)]
    # pydantic's nested models: "#/$defs/..." points from the root, which is now the call object
    defs = {k: v for p in params for k, v in (p.get("$defs") or {}).items()}
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **({"$defs": defs} if defs else {})}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image_url", "input_image", "image", "input_audio", "file", "document"):
                raise ApiError(400, f"{where}: {kind} content is not supported (plait's gateway takes text)", where)
            else:
                raise ApiError(400, f"{where}: a content part must be {{'type': 'text', 'text': ...}}, "
                                    f"got {str(part)[:80]}", where)
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", where)


def _arguments(text: Any) -> Any:
    """Tool-call arguments as the chat templates want them: the object when the text is a JSON object."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text


def _openai_message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", where)
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"{where}.role {str(role)[:40]!r} is not one of system, developer, user, assistant, tool",
                       f"{where}.role")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"{where}.tool_calls[{j}] must have function.name and function.arguments",
                               f"{where}.tool_calls")
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments") or "{}")}})
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def _openai_tools(tools: Any) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                f"'parameters': ...}}}}", f"tools[{i}]")
    return tools or None


def _in_vocab(ids: list[int], vocab: int, key: str) -> list[int]:
    """Token ids a client sent, checked before they reach an engine (an id past the embedding kills its round)."""
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"'{key}' holds token id {bad}, outside this model's vocabulary (ids 0 to {vocab - 1})", key)
    return list(ids)


def completion_request(body: Any, encode, vocab: int) -> tuple[list[int], ChatRequest]:
    """An OpenAI Completions body: (prompt token ids, the sampling); `encode(text)` tokenises text, `vocab`: the
    tokenizer's size (ids past it are refused)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    req = ChatRequest(messages=[], parse_tools=False)
    _sampling(body, req, ("max_tokens",))
    req.max_tokens = req.max_tokens or 16  # OpenAI's default for completions
    logprobs = _typed(body, "logprobs", int, lambda v: 0 <= v <= 5, "an integer from 0 to 5")
    if logprobs:
        raise ApiError(400, "'logprobs' > 0 is not supported: the engines return the sampled token's log-prob only; "
                            "use logprobs=0", "logprobs")
    req.logprobs = logprobs == 0
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt), req
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return _in_vocab(prompt, vocab, "prompt"), req
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


GENERATE_NEUTRAL = {  # SGLang sampling_params that change what is sampled, with the value that changes nothing
    "min_new_tokens": 0, "ignore_eos": False, "stop_token_ids": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "custom_params": None,
}
GENERATE_REFUSED = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "custom_logit_processor")


def generate_request(body: Any, encode, vocab: int) -> tuple[list[int], ChatRequest, bool]:
    """SGLang's `/generate` body (one prompt): (prompt token ids, the sampling, whether to return log-probs).
    `input_ids` or `text` (`encode(text)` tokenises it); `sampling_params` in SGLang's names (`max_new_tokens`,
    `temperature`, `top_p`, `top_k`, `stop`, `n`, `sampling_seed`) or vLLM's (`max_tokens`, `seed`), as verl's
    servers take both."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in GENERATE_REFUSED:
        if body.get(key) not in (None, [], {}):
            raise ApiError(400, f"'{key}' is not supported by this server (plait's /generate takes token ids or text)", key)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, f"'sampling_params' must be an object, got {str(params)[:80]!r}", "sampling_params")
    for key, neutral in GENERATE_NEUTRAL.items():
        if params.get(key) not in (neutral, None, []):
            raise ApiError(400, f"sampling_params.{key}={str(params[key])[:60]} is not supported by this server: it "
                                "would change what is sampled and plait's engines do not implement it", key)
    req = ChatRequest(messages=[], parse_tools=False)
    given = {**params, "max_tokens": params.get("max_new_tokens", params.get("max_tokens")),
             "seed": params.get("sampling_seed", params.get("seed")), "stream": body.get("stream")}
    _sampling({k: v for k, v in given.items() if k not in ("max_new_tokens", "sampling_seed")}, req, ("max_tokens",))
    if req.stream:
        raise ApiError(400, "'stream' is not supported on /generate (the engine answers when it finishes)", "stream")
    logprob = bool(_typed(body, "return_logprob", bool) or False)
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and isinstance(ids, list) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return _in_vocab(ids, vocab, "input_ids"), req, logprob
    if ids is None and isinstance(text, str) and text:
        return encode(text), req, logprob
    raise ApiError(400, "'input_ids' (a non-empty list of token ids) or 'text' (a non-empty string) is required, one "
                        "prompt per request", "input_ids")


def anthropic_request(body: Any) -> ChatRequest:
    """An Anthropic Messages body; `system` becomes a system message, tool_result blocks tool messages."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    req = ChatRequest(messages=[])
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool) or body["max_tokens"] < 1:
        raise ApiError(400, "max_tokens: field required (an integer >= 1)", "max_tokens")
    _sampling({k: v for k, v in body.items() if k != "n"}, req, ("max_tokens",))
    system = body.get("system")
    if system:
        req.messages.append({"role": "system", "content": _anthropic_text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list of messages is required", "messages")
    for i, m in enumerate(messages):
        req.messages += _anthropic_message(m, f"messages.{i}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  and isinstance(t.get("input_schema"), dict) for t in tools):
            raise ApiError(400, "tools: each tool needs 'name' and 'input_schema' (custom tools; server tools are "
                                "not supported)", "tools")
        req.tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                        "parameters": t["input_schema"]}} for t in tools] or None
    choice = (body.get("tool_choice") or {"type": "auto"})
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if kind == "tool" else None
    if kind not in ("auto", "none", "any") and not isinstance(name, str):
        raise ApiError(400, f"tool_choice {str(choice)[:80]} is not supported: use {{'type': 'auto'}}, {{'type': 'none'}}, "
                            "{'type': 'any'} or {'type': 'tool', 'name': ...}", "tool_choice")
    req.parse_tools = kind != "none" and req.tools is not None
    req.constraint = constrain(req, kind in ("any", "tool"), name, None, "")
    return req


def _anthropic_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ApiError(400, f"{where}: expected text blocks, got {str(block)[:80]}", where)
            texts.append(block["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of blocks", where)


def _anthropic_message(m: Any, where: str) -> list[dict]:
    """One Anthropic message as chat-template messages (a user turn with tool results gives tool messages)."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: must be 'user' or 'assistant', got {str(role)[:40]!r}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or a list of content blocks", f"{where}.content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and role == "user":
            body = block.get("content")
            text = _anthropic_text(body, f"{where}.content.{j}.content") if body is not None else ""
            results.append({"role": "tool", "content": text, "tool_call_id": block.get("tool_use_id")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # another model's reasoning handed back: plait's template has no place for it
        else:
            raise ApiError(400, f"{where}.content.{j}: a {kind!r} block is not supported here (text, tool_use, "
                                "tool_result)", f"{where}.content.{j}")
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


# -- responses -----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _openai_calls(choice: Choice, ids: list[str]) -> list[dict]:
    return [{"id": i, "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in zip(ids, choice.calls)]


def chat_response(req: ChatRequest, choices: list[Choice], prompt_tokens: int, call_ids: list[list[str]]) -> dict:
    out = []
    for i, (c, ids) in enumerate(zip(choices, call_ids)):
        message: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.calls else None}
        if c.calls:
            message["tool_calls"] = _openai_calls(c, ids)
        out.append({"index": i, "message": message, "finish_reason": c.finish,
                    "logprobs": {"content": _logprob_items(c)} if req.logprobs else None})
    completion = sum(len(c.token_ids) for c in choices)
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": out, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                      "total_tokens": prompt_tokens + completion}}


def _logprob_items(c: Choice) -> list[dict]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass")), "top_logprobs": []}
            for t, lp in zip(c.token_texts, c.logprobs)]


def chat_stream(req: ChatRequest, c: Choice, prompt_tokens: int, call_ids: list[str]) -> list[dict]:
    """The chunks of a streamed chat completion (one choice): role, content, tool calls, finish, usage."""
    head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}
    chunk = lambda delta, finish=None, **more: {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,  # noqa: E731
                                                                   **more}]}
    chunks = [chunk({"role": "assistant", "content": ""})]
    if c.content:
        chunks.append(chunk({"content": c.content},
                            **({"logprobs": {"content": _logprob_items(c)}} if req.logprobs else {})))
    for k, (call_id, (name, args)) in enumerate(zip(call_ids, c.calls)):
        chunks.append(chunk({"tool_calls": [{"index": k, "id": call_id, "type": "function",
                                             "function": {"name": name, "arguments": args}}]}))
    chunks.append(chunk({}, c.finish))
    if req.include_usage:
        chunks.append({**head, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids),
                                                        "total_tokens": prompt_tokens + len(c.token_ids)}})
    return chunks


def completion_response(req: ChatRequest, choices: list[Choice], prompt_tokens: int) -> dict:
    out = [{"index": i, "text": c.content, "finish_reason": "stop" if c.finish == "stop" else c.finish,
            "logprobs": {"tokens": c.token_texts, "token_logprobs": c.logprobs, "top_logprobs": None,
                         "text_offset": _offsets(c.token_texts)} if req.logprobs else None}
           for i, c in enumerate(choices)]
    completion = sum(len(c.token_ids) for c in choices)
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": out, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                      "total_tokens": prompt_tokens + completion}}


def generate_response(choices: list[Choice], prompt_tokens: int, logprob: bool, rid: str) -> dict | list[dict]:
    """SGLang's `/generate` answer: `text`, `output_ids` and `meta_info` (finish_reason as {"type": "stop",
    "matched": the EOS id or stop string} or {"type": "length", "length": n}); a list of them for n > 1."""
    out = []
    for c in choices:
        finish = ({"type": "length", "length": len(c.token_ids)} if c.finish == "length" else
                  {"type": "stop", "matched": c.stop_string if c.stop_string else (c.token_ids[-1] if c.token_ids else None)})
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids)}
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        out.append({"text": c.content, "output_ids": c.token_ids, "meta_info": meta})
    return out[0] if len(out) == 1 else out


def _offsets(texts: list[str]) -> list[int]:
    out, at = [], 0
    for t in texts:
        out.append(at)
        at += len(t)
    return out


ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_response(req: ChatRequest, c: Choice, prompt_tokens: int, call_ids: list[str]) -> dict:
    blocks: list[dict] = [{"type": "text", "text": c.content}] if c.content or not c.calls else []
    blocks += [{"type": "tool_use", "id": i, "name": name, "input": _input(args)} for i, (name, args) in zip(call_ids, c.calls)]
    reason = "stop_sequence" if c.stop_string else ANTHROPIC_STOP[c.finish]
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": req.model, "content": blocks,
            "stop_reason": reason, "stop_sequence": c.stop_string,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(c.token_ids)}}


def _input(args: str) -> dict:
    value = _arguments(args)
    return value if isinstance(value, dict) else {"arguments": value}


def anthropic_stream(message: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed Messages answer, built from its whole body."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}}
    events = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            events += [("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {"type": "text", "text": ""}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": i,
                                                "delta": {"type": "text_delta", "text": block["text"]}})]
        else:
            events += [("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": i,
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json": json.dumps(block["input"])}})]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                                     "stop_sequence": message["stop_sequence"]},
                                  "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
               ("message_stop", {"type": "message_stop"})]
    return events
