"""A session: one row's rollout as an outside agent drives it, call by call, kept as token ids.

Every call's messages are matched against the states the session already holds. A state is the
canonical form of the messages so far (role, text, tool calls with their arguments as sorted JSON;
ids and spacing ignored) and the trajectory's token ids for them (plait/agents/tokens.py):

    request messages ──longest match──▶ a reply state R whose messages are a prefix of them
                                          -> only the new messages are tokenised (the chat template's
                                             suffix diff, mask 0) after R's ids; R's sampled ids stay
                       ──exact match───▶ a context state (the same request again: another sample of it)
                       ──no match──────▶ a new chain: the messages rendered afresh as its prompt

so an agent that appends to its history extends one trajectory, and one that rewrites it (compacts,
edits, drops a turn) starts a new chain instead of misaligning tokens. The assistant's answer is
appended exactly as sampled (mask 1, its log-probs and policy versions), never re-tokenised from the
text the agent echoes back. A turn that did not end with an end-of-turn token (cut by a stop string or
max_tokens) is closed with the template's closing tokens (mask 0) before messages are appended to it.

At the end the session's trajectories are its leaves: every reply state nothing was appended to. A
sampled turn shared by several leaves (the prefix of a branch) is trained once, in the first leaf;
in the others it is attended with mask 0. The last leaf to be answered is the session's final one:
the reward function reads its conversation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from plait.agents.tokens import ContinuousTokens, PrefixUnstable, Trajectory
from plait.serving.protocol import ApiError
from plait.workers.grammar import masks

Key = tuple  # a message's canonical form


def message_key(m: dict) -> Key:
    calls = tuple((c["function"]["name"], _canonical(c["function"].get("arguments")))
                  for c in m.get("tool_calls") or [])
    return (m["role"], (m.get("content") or "").strip(), calls)


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


@dataclass
class State:
    """The messages so far (their keys) and their token ids. A reply state ends with a sampled turn."""
    id: int
    keys: tuple
    tools: str                      # the tool schemas' canonical JSON ("" without tools)
    traj: Trajectory
    reply: bool
    turns: tuple = ()               # (reply state id, start, end): sampled spans in response coordinates
    closed: bool = True             # ends with an end-of-turn token (or is a context state)
    extended: bool = False


@dataclass
class Span:
    """One call's timing (wall clock): queued until its engine round began, prefilling until `prefilled` (0:
    the engine does not say), decoding until `finished`."""
    submitted: float
    started: float
    prefilled: float
    finished: float
    tokens: int


@dataclass
class Session:
    """One row's rollout through the gateway (see the module docstring)."""
    id: str
    label: str                       # "row 12" (for messages)
    ct: ContinuousTokens
    prompt_limit: int                # data.max_prompt_length
    response_limit: int              # data.max_response_length, per chain
    closing: list[int]               # the template's tokens after an assistant message's text
    eos: set[int]
    generate: Any = None             # the run's engine queue: await generate(request_id=, prompt_ids=, sampling_params=)
    sampling: dict = field(default_factory=dict)  # the rollout's sampling: temperature, top_p, top_k, do_sample
    states: list[State] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    reward: Optional[float] = None   # POST /sessions/{id}/reward
    opened: float = field(default_factory=time.time)
    overridden: set = field(default_factory=set)  # sampling fields a request asked to change (training keeps the rollout's)
    calls: int = 0                   # tool calls read from the answers (as the API's tool_calls)
    call_blocks: int = 0             # tool-call blocks the answers wrote, parsed or not
    unparsed: int = 0                # answers with a call block the parser could not read (returned as text)
    responses: dict = field(default_factory=dict)  # Responses API: response id -> its conversation (previous_response_id)
    cut: bool = False                # an answer was cut by the chain's response budget: the episode is over

    # -- a call's context ------------------------------------------------------------------------

    def context(self, messages: list[dict], tools: Optional[list[dict]]) -> State:
        """The state to sample from for these messages: extended, reused or a new chain."""
        keys, tkey = tuple(message_key(m) for m in messages), _tools_key(tools)
        if messages[-1]["role"] == "assistant":
            raise ApiError(400, "the messages end with an assistant message (a prefill): not supported; end with a "
                                "user or tool message", "messages")
        best = None
        for s in self.states:
            n = len(s.keys)
            if s.tools != tkey or n > len(keys) or keys[:n] != s.keys:
                continue
            if (not s.reply and n == len(keys)) or (s.reply and n < len(keys)):
                if best is None or n > len(best.keys) or (n == len(best.keys) and not s.reply):
                    best = s
        if best is not None and not best.reply:
            return best
        if best is not None:
            return self._extend(best, messages[len(best.keys):], keys, tkey, tools)
        try:
            ids = self.ct.render(messages, True, tools)
        except PrefixUnstable as err:
            raise ApiError(400, str(err), "messages") from None
        return self._root(ids, keys, tkey)

    def context_ids(self, prompt_ids: list[int]) -> State:
        """As `context`, for a completion call's token ids: extended where an earlier state's ids are a
        prefix of them, else a new chain (a text prompt re-tokenised differently starts a new one)."""
        best = None
        for s in self.states:
            n = len(s.traj.ids)
            if s.tools == "\0ids" and prompt_ids[:n] == s.traj.ids and (
                    (s.reply and n < len(prompt_ids)) or (not s.reply and n == len(prompt_ids))):
                if best is None or n > len(best.traj.ids):
                    best = s
        if best is not None and not best.reply:
            return best
        if best is None:
            return self._root(list(prompt_ids), (), "\0ids")
        t = _copy(best.traj)
        added = prompt_ids[len(t.ids):]
        _append_context(t, added)
        return self._add(State(len(self.states), (), "\0ids", t, reply=False, turns=best.turns), best)

    def _root(self, ids: list[int], keys: tuple, tkey: str) -> State:
        if len(ids) > self.prompt_limit:
            raise ApiError(400, f"this conversation starts a new chain of {len(ids)} prompt tokens, more than "
                                f"data.max_prompt_length={self.prompt_limit}", "messages", code="context_length_exceeded")
        return self._add(State(len(self.states), keys, tkey, Trajectory(ids=list(ids)), reply=False), None)

    def _extend(self, base: State, new: list[dict], keys: tuple, tkey: str, tools) -> State:
        t = _copy(base.traj)
        if not base.closed:
            _append_context(t, self.closing)
        try:
            self.ct.add_messages(t, [], list(new), tools)
        except (PrefixUnstable, ValueError) as err:
            raise ApiError(400, f"these messages cannot be appended token for token: {err}", "messages") from None
        return self._add(State(len(self.states), keys, tkey, t, reply=False, turns=base.turns), base)

    def _add(self, state: State, base: Optional[State]) -> State:
        if base is not None:
            base.extended = True
        self.states.append(state)
        return state

    def room(self, ctx: State) -> int:
        """Tokens the chain may still sample (its response budget less what it holds)."""
        return self.response_limit - len(ctx.traj.mask)

    def add_reply(self, ctx: State, keys: tuple, token_ids: list[int], logprobs: list[float],
                  versions: list[int], grammar=None) -> State:
        """The sampled answer appended to `ctx` as it came (mask 1); `keys`: the reply's canonical message;
        `grammar`: the decoding grammar it was sampled under (None: none), replayed when it becomes a batch row."""
        t = _copy(ctx.traj)
        start = len(t.mask)
        self.ct.add_assistant(t, token_ids, logprobs, versions)
        if grammar is not None and token_ids:
            t.grammars.append((start, len(t.mask), grammar))
        state = State(len(self.states), ctx.keys + (keys,), ctx.tools, t, reply=True,
                      turns=ctx.turns + ((len(self.states), start, len(t.mask)),),
                      closed=bool(token_ids) and token_ids[-1] in self.eos)
        self.states.append(state)
        return state

    # -- at the end ------------------------------------------------------------------------------

    def trajectories(self) -> list[Trajectory]:
        """The leaves, oldest first, the final one last; a sampled turn shared by several is masked in all but
        the first that holds it."""
        leaves = [s for s in self.states if s.reply and not s.extended]
        claimed: set[int] = set()
        out = []
        for leaf in leaves:
            t = _copy(leaf.traj)
            for turn, start, end in leaf.turns:
                if turn in claimed:
                    t.mask[start:end] = [0] * (end - start)
                claimed.add(turn)
            out.append(t)
        return out

    def grammar_masks(self, limit: int) -> list[dict]:
        """Per trajectory (as `trajectories` orders them), its spans sampled under a grammar replayed over the
        sampled tokens (plait/workers/grammar.py masks), cut at `limit` response tokens. ValueError: a token its
        grammar does not allow."""
        return [masks(t.ids[t.prompt_len:], t.grammars, limit) for t in self.trajectories()]

    def replies(self) -> int:
        return sum(s.reply for s in self.states)


def _tools_key(tools: Optional[list[dict]]) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _copy(t: Trajectory) -> Trajectory:
    return Trajectory(ids=list(t.ids), mask=list(t.mask), logprobs=list(t.logprobs), versions=list(t.versions),
                      grammars=list(t.grammars))


def _append_context(t: Trajectory, ids: list[int]) -> None:
    t.ids += ids
    t.mask += [0] * len(ids)
    t.logprobs += [0.0] * len(ids)
    t.versions += [-1] * len(ids)


def closing_ids(ct: ContinuousTokens) -> list[int]:
    """The tokens the chat template writes after an assistant message's text (e.g. `<|im_end|>\\n`): what a
    re-rendered history holds after a turn that the engine cut before its end-of-turn token."""
    marker = "continuous token closing marker"
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        prompt = ct.render(head, True)
        full = ct.render(head + [{"role": "assistant", "content": marker}], False)
    except Exception:  # noqa: BLE001 - a template that cannot render this: no closing tokens
        return []
    body = full[len(prompt):] if full[:len(prompt)] == prompt else full
    mark = ct.tokenizer.encode(marker, add_special_tokens=False)
    for i in range(len(body) - len(mark), -1, -1):
        if body[i:i + len(mark)] == mark:
            return body[i + len(mark):]
    return []
