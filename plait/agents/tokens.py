"""Continuous Token bookkeeping for multi-turn rollouts, with verl 0.9.1's rules.

A trajectory is one growing list of token ids. Assistant turns are appended exactly as the engine
sampled them (never decoded and re-encoded), with mask 1 and their log-probs. Anything else added
to the conversation (tool results, user or system messages) is tokenized as the SUFFIX DIFF of the
chat template: the template rendered over a stand-in prefix, and over that prefix plus the new
messages; the new tokens are what the second adds to the first. If the second rendering does not
start with the first (the template rewrites earlier turns: the prefix is not stable) that is an
error naming the roles, never a silent re-tokenization. Those tokens get mask 0 and log-prob 0.

The stand-in prefix is verl's: a synthetic system and user message (and for tool results an
assistant message calling tools of the same names), so any template that renders messages
locally gives the same ids as verl. Model-family boundary rule: ChatML templates (the Qwen family,
when the tokenizer has `<|im_end|>`) render `<|im_end|>\\n` after a turn while generation stops at
`<|im_end|>`, so the missing newline is inserted (mask 0) before the new messages, as verl's Qwen
builder does. Left out: verl's other family rules (gpt-oss, GLM, MiniMax, Gemma 4, DeepSeek) and
multimodal prompts; a model of those families gets the default rule (`family` says which ran).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SYSTEM = {"role": "system", "content": "continuous token synthetic system"}
USER = {"role": "user", "content": "continuous token synthetic user"}
QWEN_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
APPEND_ROLES = ("tool", "user", "system", "assistant")


class PrefixUnstable(ValueError):
    """The chat template changed earlier tokens when messages were appended."""


@dataclass
class Trajectory:
    """The runtime ids of one conversation and, for its response part, the masks and log-probs."""
    ids: list[int]                                        # prompt + response so far
    mask: list[int] = field(default_factory=list)         # [response] 1 sampled, 0 added by the loop
    logprobs: list[float] = field(default_factory=list)   # [response] 0.0 where mask is 0
    versions: list[int] = field(default_factory=list)     # [response] policy version, -1 where mask is 0
    grammars: list = field(default_factory=list)          # [(start, end, Grammar)]: response spans sampled under a
    #   decoding grammar (the gateway's forced calls and JSON answers; plait/workers/grammar.py masks)

    @property
    def prompt_len(self) -> int:
        return len(self.ids) - len(self.mask)


class ContinuousTokens:
    def __init__(self, tokenizer, model_type: Optional[str] = None, chat_template_kwargs: dict | None = None):
        self.tokenizer, self.kwargs = tokenizer, dict(chat_template_kwargs or {})
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
        newline = tokenizer.encode("\n", add_special_tokens=False)
        self.family = "qwen" if model_type in QWEN_TYPES and im_end is not None and len(newline) == 1 else "default"
        self._im_end, self._newline = im_end, newline[0] if len(newline) == 1 else None

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, **self.kwargs)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]

    def initial(self, messages: list[dict], tools: list[dict] | None, prompt_length: int) -> Trajectory:
        """The first prompt (generation prompt added), left-truncated to `prompt_length` as verl does."""
        ids = self.render(messages, True, tools)
        return Trajectory(ids=ids[-prompt_length:])

    def add_assistant(self, t: Trajectory, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append sampled ids exactly as they came, mask 1."""
        t.ids += token_ids
        t.mask += [1] * len(token_ids)
        t.logprobs += list(logprobs)
        t.versions += list(versions)

    def add_messages(self, t: Trajectory, previous: list[dict], updated: list[dict],
                     tools: list[dict] | None = None) -> int:
        """Append the messages `updated` has beyond `previous` (append-only), mask 0; returns the count added."""
        if updated[:len(previous)] != previous:
            raise ValueError("Continuous Token messages must be append-only: earlier messages changed")
        new = updated[len(previous):]
        bad = [m.get("role") for m in new if m.get("role") not in APPEND_ROLES]
        if bad:
            raise ValueError(f"Continuous Token appends roles {list(APPEND_ROLES)}, got {bad[0]!r}")
        added = self.delta(new, tools)
        if self.family == "qwen" and t.ids and t.ids[-1] == self._im_end:
            added = [self._newline] + added
        t.ids += added
        t.mask += [0] * len(added)
        t.logprobs += [0.0] * len(added)
        t.versions += [-1] * len(added)
        return len(added)

    def delta(self, new: list[dict], tools: list[dict] | None) -> list[int]:
        """Token ids of `new` messages + the generation prompt: suffix diffs, one group at a time."""
        groups = _groups(new)
        out: list[int] = []
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            role = group[0]["role"]
            if role == "assistant" and last:
                raise ValueError("Continuous Token context messages cannot end with an assistant message")
            prefix = [SYSTEM, USER, _synthetic_assistant(group)] if role == "tool" else [SYSTEM, USER]
            out += self.suffix(prefix, group, add_generation_prompt=last, tools=tools)
        return out

    def suffix(self, prefix: list[dict], appended: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None) -> list[int]:
        """The prefix-stability check: render(prefix + appended) must start with render(prefix)."""
        head = self.render(prefix, False, tools)
        full = self.render(prefix + appended, add_generation_prompt, tools)
        if full[:len(head)] != head:
            roles = [m.get("role") for m in appended]
            raise PrefixUnstable(f"the chat template is not prefix-stable when {roles} messages are appended: "
                                 "rendering them changes earlier tokens, so multi-turn token ids cannot be kept")
        return full[len(head):]


def _groups(messages: list[dict]) -> list[list[dict]]:
    """Consecutive tool messages form one group; every other message is a group of its own."""
    groups: list[list[dict]] = []
    for m in messages:
        if m["role"] == "tool" and groups and groups[-1][0]["role"] == "tool":
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def _synthetic_assistant(tool_messages: list[dict]) -> dict[str, Any]:
    calls = [{"id": m.get("tool_call_id") if m.get("tool_call_id") is not None else f"continuous_token_call_{i}",
              "type": "function",
              "function": {"name": str(m.get("name") or "continuous_token_tool"), "arguments": {}}}
             for i, m in enumerate(tool_messages)]
    return {"role": "assistant", "content": "", "reasoning_content": "reasoning", "tool_calls": calls}
