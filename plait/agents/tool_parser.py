"""Tool calls out of an assistant turn's text, as verl 0.9.1's `multi_turn.format` parsers read them.

One format: `hermes` (Qwen2.5/Qwen3, SmolLM2 and most open chat templates), where each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. verl's reading, kept here:

- the text is the turn decoded with special tokens kept; when it lacks either tag it is the
  content as is, with no calls;
- every `<tool_call>...</tool_call>` block (shortest match, across lines) is one candidate; a block
  whose body is not a JSON object with a string "name" and an "arguments" key is skipped and logged,
  never raised: the model gets no answer for it;
- a call's arguments are the parsed "arguments" value written back as JSON (`ensure_ascii=False`),
  not the model's spelling: `{"a":1}` becomes `{"a": 1}`, a string stays a JSON string;
- the content is the text with every block removed, skipped ones included; whitespace around them
  stays.

`gpt-oss` (OpenAI's harmony format), as verl 0.9.1 reads it: the turn decoded with special tokens
kept; its reasoning messages (`<|start|>assistant<|channel|>analysis<|message|>...<|end|>`, or the
same without the `<|start|>assistant` head, which the generation prompt holds) are removed first;
then each `<|start|>assistant<|channel|>CHANNEL to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
is a call whose arguments are ARGS as written (not checked here: the tool box answers arguments that
are not JSON with verl's error text); the content is what is left with the calls removed. As in
verl, a call must carry its own `<|start|>assistant` head.

Left out: verl's other formats (qwen3_coder, glm, seed, minimax, kimi, deepseek_v4, gemma4); the
config refuses them by name. Calls carry no `tool_call_id` (neither format has one here). verl
also strips the tokenizer's pad token from a gpt-oss turn; plait's engines return no pad tokens.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUPPORTED_FORMATS: tuple[str, ...] = ("hermes", "gpt-oss")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

_HARMONY_REASONING = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
_HARMONY_CALL = re.compile(r"<\|start\|>assistant<\|channel\|>[^<]* to=functions\.([^<]+) "
                           r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", re.DOTALL)
_HARMONY_OPENER = "to=functions."


@dataclass(frozen=True)
class FunctionCall:
    """One call the model asked for."""
    name: str
    arguments: str  # JSON text: the parsed "arguments" value, re-serialised as verl does


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[FunctionCall]]:
    """(the assistant content without the call blocks, the calls in the order written)."""
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"multi_turn.format={fmt!r} is not supported; valid: {', '.join(SUPPORTED_FORMATS)}")
    if fmt == "gpt-oss":
        return _harmony_calls(text)
    if _HERMES_OPEN not in text or _HERMES_CLOSE not in text:
        return text, []
    calls = []
    for body in _HERMES_BLOCK.findall(text):
        call = _hermes_call(body)
        if call is None:
            logger.warning("skipped a tool call that is not a JSON object with 'name' and 'arguments': %.120r", body)
        else:
            calls.append(call)
    return _HERMES_BLOCK.sub("", text), calls


def count_call_blocks(text: str, fmt: str = "hermes") -> int:
    """How many calls the turn tried to write: its opening tags, parsed or not (a cut or malformed
    block counts), the denominator of the valid-call rate."""
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"multi_turn.format={fmt!r} is not supported; valid: {', '.join(SUPPORTED_FORMATS)}")
    if fmt == "gpt-oss":
        return _HARMONY_REASONING.sub("", text).count(_HARMONY_OPENER)
    return text.count(_HERMES_OPEN)


def _harmony_calls(text: str) -> tuple[str, list[FunctionCall]]:
    text = _HARMONY_REASONING.sub("", text)  # reasoning may mention calls; they are not calls
    calls = [FunctionCall(name=name, arguments=args) for name, args in _HARMONY_CALL.findall(text)]
    return (_HARMONY_CALL.sub("", text) if calls else text), calls


def _hermes_call(body: str) -> FunctionCall | None:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # verl skips on any exception
        return None
    if not isinstance(parsed, dict) or "arguments" not in parsed or not isinstance(parsed.get("name"), str):
        return None
    return FunctionCall(name=parsed["name"], arguments=json.dumps(parsed["arguments"], ensure_ascii=False))
