"""OpenAI's Responses API (`POST /v1/responses`) as a chat call: input items become the chat-template messages a
chat completion would carry, `Gateway.chat` samples them, and the one answer goes back as output items or as the
SDK's stream of events. Inside a training session the call is therefore tokenised by the same Continuous-Token
builder as a chat completion (plait/serving/sessions.py): there is no second token path, and the trained tokens
are the sampled ones.

In: `input` (a string, or items: messages with input_text / output_text parts, `function_call` and
`function_call_output`; another model's `reasoning` items are skipped), `instructions` (a system message, not
carried to the next response, as OpenAI does), function `tools`, `tool_choice` (auto, none, required or a named
function) and `text.format` (text, json_object, json_schema: grammar-constrained, as for chat), `max_output_tokens`,
`temperature`, `top_p`, `stream`, `include` (`message.output_text.logprobs` adds each token's log-prob) and
`previous_response_id`: each response's conversation is remembered (with its session, or by the server outside
sessions, the last REMEMBERED of them) so that the next call continues it. Out: `message` and `function_call`
items (with `call_id`), `usage`, and status `incomplete` (reason `max_output_tokens`) where the budget cut the
answer. Refused with a 400 naming the field, because plait cannot honour them: built-in tools, `reasoning`,
`conversation`, stored `prompt`s, `background`, `truncation: auto`, `top_logprobs` > 0, images and files.

Left out: GET / DELETE `/v1/responses/{id}` and its input items, and token-by-token streaming (a stream carries the
whole answer in one delta, as for chat completions: the engine answers a request when it finishes).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from plait.serving.protocol import (ApiError, ChatRequest, Choice, _arguments, _logprob_items, _sampling, _text, constrain,
                                    new_id)

REMEMBERED = 4096  # conversations kept for previous_response_id per store (a session's, or the server's outside them)
SAMPLING = ("model", "temperature", "top_p", "top_k", "seed", "max_output_tokens", "stream")
LOGPROBS = "message.output_text.logprobs"
REFUSED = {  # field: (what asks nothing of plait, why anything else is refused)
    "background": (False, "a response is answered in its request"),
    "conversation": (None, "plait keeps no conversation objects; send previous_response_id or the whole input"),
    "prompt": (None, "plait has no stored prompts; send instructions and input"),
    "reasoning": (None, "the served model has no reasoning settings; send effort 'none' or leave it out"),
    "truncation": ("disabled", "plait never drops input items; a conversation too long is a 400"),
    "context_management": (None, "plait never compacts the input"),
    "top_logprobs": (0, "the engines return the sampled token's log-prob only"),
}


async def respond(gateway, body: Any, session, remembered: dict) -> dict:
    """The Response body for a request body, sampled by `gateway.chat` (in `session`, or outside sessions);
    `remembered`: response id -> conversation, where this response's is added."""
    req, conversation = request(body, remembered)
    req.model = req.model or gateway.model_name
    [choice], prompt_tokens = await gateway.chat(req, session)
    out = response(body, req, choice, prompt_tokens)
    calls = [item for item in out["output"] if item["type"] == "function_call"]
    reply: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if calls:
        reply["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}} for c in calls]
    remembered[out["id"]] = conversation + [reply]
    while len(remembered) > REMEMBERED:
        del remembered[next(iter(remembered))]  # the oldest (dicts keep insertion order)
    return out


def request(body: Any, remembered: dict) -> tuple[ChatRequest, list[dict]]:
    """(the chat request, the conversation less the instructions: what a next response continues)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, (neutral, why) in REFUSED.items():
        value = body.get(key)
        # an object asks nothing where all it holds is null or "none" (openai-agents sends reasoning {"effort": "none"})
        if value not in (None, neutral) and not (isinstance(value, dict) and all(v in (None, "none") for v in value.values())):
            raise ApiError(400, f"'{key}'={str(value)[:60]} is not supported by this server: {why}", key)
    req = ChatRequest(messages=[])
    _sampling({k: body[k] for k in SAMPLING if k in body}, req, ("max_output_tokens",))
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise ApiError(400, f"'include' must be a list of strings, got {str(include)[:80]!r}", "include")
    req.logprobs = LOGPROBS in include
    text = body.get("text") or {}
    fmt = (text.get("format") or {}) if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise ApiError(400, f"text.format {str(text)[:80]} must be an object", "text.format")
    req.tools = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    name = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if choice not in ("auto", "none", "required", None) and not isinstance(name, str):
        raise ApiError(400, f"tool_choice {str(choice)[:80]!r} is not supported: use 'auto', 'none', 'required' or "
                            "{'type': 'function', 'name': ...}", "tool_choice")
    req.parse_tools = choice != "none" and req.tools is not None
    req.constraint = constrain(req, choice == "required" or name is not None, name, fmt, "text.format")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or previous not in remembered):
        raise ApiError(404, f"previous response {str(previous)[:60]!r} not found: responses are remembered within their "
                            "session (outside sessions, the server's last "
                            f"{REMEMBERED})", "previous_response_id", code="previous_response_not_found")
    conversation = (remembered[previous] if previous else []) + _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "instructions")
    req.messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not req.messages:
        raise ApiError(400, "'input' must be a non-empty string or list of items", "input")
    return req, conversation


def _messages(items: Any) -> list[dict]:
    """Input items as chat-template messages; an assistant turn's text and the function calls after it are one
    message, as a chat completion answers them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, f"'input' must be a string or a list of items, got {str(items)[:80]!r}", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"{at}.role {str(role)[:40]!r} is not one of user, assistant, system, developer",
                               f"{at}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{at}: a function_call item needs 'name' and 'call_id'", at)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = out[-1].get("tool_calls", []) + [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), f"{at}.output")})
        elif kind == "reasoning":
            continue  # another model's reasoning handed back: plait's answers have none, its template no place for it
        else:
            raise ApiError(400, f"{at}: a {str(kind)[:40]!r} item is not supported here (message, function_call, "
                                "function_call_output)", at)
    return out


def _tools(tools: Any) -> Optional[list[dict]]:
    """Responses function tools ({type, name, description, parameters}) in Chat Completions' form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str) or not t["name"]:
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{i}]: a {str(kind)[:40]!r} tool is not supported; plait serves function tools "
                                "({'type': 'function', 'name': ..., 'parameters': ...})", f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                      if t.get(k) is not None}})
    return out or None


def response(body: dict, req: ChatRequest, c: Choice, prompt_tokens: int) -> dict:
    """The Response object for one sampled answer: its text as a message item, each tool call a function_call."""
    cut = c.finish == "length"
    status = "incomplete" if cut else "completed"
    items: list[dict] = []
    if c.content or not c.calls:
        text = {"type": "output_text", "text": c.content, "annotations": [],
                "logprobs": _logprob_items(c) if req.logprobs else []}
        items.append({"type": "message", "id": new_id("msg_"), "status": status, "role": "assistant", "content": [text]})
    items += [{"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"), "name": name,
               "arguments": args, "status": "completed"} for name, args in c.calls]
    now = int(time.time())
    return {"id": new_id("resp_"), "object": "response", "created_at": now, "status": status,
            "completed_at": None if cut else now, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"), "max_output_tokens": req.max_tokens, "model": req.model,
            "output": items, "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True) is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [], "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + len(c.token_ids)}}


def events(resp: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed response, built from its whole body in the order OpenAI sends them."""
    start = {**resp, "status": "in_progress", "output": [], "usage": None, "completed_at": None,
             "incomplete_details": None}
    out: list[tuple[str, dict]] = [("response.created", {"response": start}), ("response.in_progress", {"response": start})]
    for i, item in enumerate(resp["output"]):
        at = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            out += [("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress",
                                                                               "content": []}}),
                    ("response.content_part.added", {**at, "content_index": 0, "part": {**part, "text": "", "logprobs": []}}),
                    ("response.output_text.delta", {**at, "content_index": 0, "delta": part["text"],
                                                    "logprobs": part["logprobs"]}),
                    ("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                   "logprobs": part["logprobs"]}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": part})]
        else:
            out += [("response.output_item.added", {"output_index": i, "item": {**item, "status": "in_progress",
                                                                               "arguments": ""}}),
                    ("response.function_call_arguments.delta", {**at, "delta": item["arguments"]}),
                    ("response.function_call_arguments.done", {**at, "name": item["name"], "arguments": item["arguments"]})]
        out.append(("response.output_item.done", {"output_index": i, "item": item}))
    out.append((f"response.{resp['status']}", {"response": resp}))
    return [(kind, {"type": kind, "sequence_number": n, **data}) for n, (kind, data) in enumerate(out)]
