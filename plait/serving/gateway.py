"""The server's engine side: a chat or completion call in, token ids to the engine, an answer out.

    HTTP (server.py) ──ChatRequest──▶ Gateway.chat ──▶ Session.context (training) or a fresh render
                                          │  await generate(prompt_ids, sampling)    [the engine's queue:
                                          ▼                                           plait/agents/runner.py]
                                     read_answer: stop strings, tool calls (multi_turn.format) ──▶ Choice

Training calls belong to a session (one row's rollout, plait/serving/sessions.py): they sample with the
rollout's settings (rollout.temperature, top_p, top_k: the trainer's log-probs are computed with them),
so a request asking for others is answered with the rollout's, counted per session and said once per
run; their budget is the chain's response budget. Calls outside a session (`plait serve`, a judge)
sample as the request asks, with the server's defaults where it asks nothing (a judge's: its rollout block,
as verl's reward server's override_generation_config); a call with a `seed` (or every call, where the server
has one: a judge with full_determinism) is sampled alone with its own generator. Every sampled token is kept
with its log-prob and policy version. A forced tool call or a JSON answer (protocol.Constraint) is sampled under
its grammar (plait/workers/grammar.py), in sessions too: the session records which reply tokens were sampled under
which grammar, and the trainer takes their log-probs over the grammar's allowed set (docs/agents.md "Forced tool
calls and structured output"). An engine that takes no grammar answers such a call with a 400 (its row's
`grammar` entry in the engine table).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import Any, Awaitable, Callable, Optional

from plait.agents.tokens import ContinuousTokens, PrefixUnstable
from plait.agents.tool_parser import count_call_blocks, parse_tool_calls
from plait.serving.protocol import ApiError, ChatRequest, Choice
from plait.serving.sessions import Session, Span, closing_ids, message_key
from plait.workers.engine import ENGINES
from plait.workers.grammar import Grammars, unavailable

CALL_TAGS = {"hermes": ("<tool_call>\n", "\n</tool_call>")}  # a forced call as plait's tool parsers read it

Generate = Callable[..., Awaitable[Any]]  # the engine queue's generate(request_id=, prompt_ids=, sampling_params=)


class Gateway:
    def __init__(self, tokenizer, model_type: Optional[str], tool_format: str, eos_ids: list[int], model_name: str,
                 generate: Optional[Generate] = None, max_tokens: int = 1024, defaults: Optional[dict] = None,
                 seed: Optional[int] = None, context: Optional[int] = None, grammars: Optional[Grammars] = None,
                 no_grammar: str = "this server was started without grammars"):
        """`generate`: the engine queue for calls outside sessions (None: every call must name a session);
        `max_tokens`: their default budget; `defaults`: their temperature, top_p and top_k where a call names
        none; `seed`: a call's seed where it names none (None: unseeded); `context`: prompt + answer tokens a
        call may hold (None: no bound), its budget clamped to what is left. `grammars`: the served tokenizer's,
        where the engine honours a decoding grammar (forced tool calls, JSON answers); else `no_grammar` says why not."""
        self.tokenizer, self.format, self.eos, self.model_name = tokenizer, tool_format, set(eos_ids), model_name
        self.ct = ContinuousTokens(tokenizer, model_type)
        self.closing = closing_ids(self.ct)
        self.sessions: dict[str, Session] = {}
        self.plain, self.max_tokens, self.seed, self.context = generate, max_tokens, seed, context
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, **(defaults or {})}
        self.said: set[str] = set()
        self.specials = [s for s in tokenizer.all_special_tokens if s]
        self.grammars, self.no_grammar = grammars, no_grammar

    # -- sessions --------------------------------------------------------------------------------

    def open(self, label: str, generate: Generate, sampling: dict, prompt_limit: int, response_limit: int) -> Session:
        session = Session(uuid.uuid4().hex, label, self.ct, prompt_limit, response_limit, self.closing, self.eos,
                          generate=generate, sampling=dict(sampling))
        self.sessions[session.id] = session
        return session

    def close(self, session_id: str) -> Optional[Session]:
        return self.sessions.pop(session_id, None)

    def session(self, session_id: Optional[str]) -> Optional[Session]:
        """The session a call names; None for a call outside sessions where the server takes those."""
        if session_id is not None and session_id in self.sessions:
            return self.sessions[session_id]
        if self.plain is not None and session_id is None:
            return None
        if session_id is None:
            raise ApiError(401, "no session: while plait trains, call /sessions/{id}/v1/... or send the session id as "
                                "the API key (OPENAI_API_KEY / ANTHROPIC_API_KEY)", kind="authentication_error")
        raise ApiError(404 if self.plain is None else 401, f"no open session {session_id[:40]!r} (it ended, or the "
                                                           "key is not a session id)", kind="not_found_error")

    # -- calls -----------------------------------------------------------------------------------

    async def chat(self, req: ChatRequest, session: Optional[Session]) -> tuple[list[Choice], int]:
        """The request's choices and its prompt's token count."""
        grammar = self.grammar(req).get("grammar")
        if session is None:
            try:
                ids = self.ct.render(req.messages, True, req.tools)
            except (PrefixUnstable, ValueError, TypeError) as err:
                raise ApiError(400, f"the chat template cannot render these messages: {err}", "messages") from None
            except Exception as err:  # noqa: BLE001 - jinja's own errors (a template that raises on a role order)
                raise ApiError(400, f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                               "messages") from None
            outs = await self._sample(None, ids, req, req.n, grammar=grammar)
            return [self.read_answer(o, req) for o in outs], len(ids)
        ctx = session.context(req.messages, req.tools)
        choices = []
        for out in await self._sample(session, ctx.traj.ids, req, req.n, room=session.room(ctx), grammar=grammar):
            choice = self.read_answer(out, req)
            reply = {"role": "assistant", "content": choice.content,
                     "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in choice.calls]}
            session.add_reply(ctx, message_key(reply), choice.token_ids, choice.logprobs, out.versions[:len(choice.token_ids)],
                              grammar)
            session.call_blocks += choice.call_blocks
            session.unparsed += choice.call_blocks > len(choice.calls)
            session.calls += len(choice.calls)
            choices.append(choice)
        return choices, len(ctx.traj.ids)

    async def complete(self, prompt_ids: list[int], req: ChatRequest, session: Optional[Session]) -> tuple[list[Choice], int]:
        grammar = self.grammar(req).get("grammar")
        if session is None:
            outs = await self._sample(None, prompt_ids, req, req.n, grammar=grammar)
            return [self.read_answer(o, req) for o in outs], len(prompt_ids)
        ctx = session.context_ids(prompt_ids)
        choices = []
        for out in await self._sample(session, ctx.traj.ids, req, req.n, room=session.room(ctx), grammar=grammar):
            choice = self.read_answer(out, req)
            session.add_reply(ctx, (), choice.token_ids, choice.logprobs, out.versions[:len(choice.token_ids)], grammar)
            choices.append(choice)
        return choices, len(ctx.traj.ids)

    async def _sample(self, session: Optional[Session], ids: list[int], req: ChatRequest, n: int, room: int = 0,
                      grammar=None) -> list:
        """`n` samples of `ids`, with a session's sampling or the call's, under `grammar` (None: unconstrained)."""
        if session is None:
            sampling, budget, generate = self.plain_sampling(req, len(ids)), req.max_tokens or self.max_tokens, self.plain
            if self.context is not None:
                budget = min(budget, self.context - len(ids))
        else:
            sampling, generate = session.sampling, session.generate
            self._keep_rollout_sampling(session, req)
            budget = min(req.max_tokens or room, room)
            if budget <= 0:  # the chain's response budget is used up: answered as cut, nothing sampled
                session.cut = True
                return [_Empty() for _ in range(n)]
        if grammar is not None:
            sampling = {**sampling, "grammar": grammar}
        spans = []

        async def one(k: int):
            submitted = _now()
            seeded = {"seed": sampling["seed"] + k} if "seed" in sampling else {}  # n seeded samples differ
            out = await generate(request_id=uuid.uuid4().hex, prompt_ids=list(ids),
                                 sampling_params={**sampling, **seeded, "max_tokens": budget})
            spans.append(Span(submitted, out.started or submitted, out.prefilled, _now(), len(out.token_ids)))
            return out
        outs = await asyncio.gather(*(one(k) for k in range(n)))
        if session is not None:
            session.spans += spans
            session.cut |= budget == room and any(o.stop_reason == "length" for o in outs)
        return outs

    def plain_sampling(self, req: ChatRequest, prompt_tokens: int) -> dict:
        """A call's sampling outside sessions: what it asks, else the server's defaults; its seed, if any."""
        if self.context is not None and prompt_tokens >= self.context:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens and this server holds {self.context} in all "
                                "(prompt and answer)", "messages", code="context_length_exceeded")
        asked = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        sampling = {k: self.defaults[k] if v is None else v for k, v in asked.items()}
        greedy = sampling["temperature"] == 0
        sampling.update(temperature=1.0 if greedy else sampling["temperature"], do_sample=not greedy)
        seed = self.seed if req.seed is None else req.seed
        return sampling if seed is None else {**sampling, "seed": seed}

    def grammar(self, req: ChatRequest) -> dict:
        """The sampling key of a call's constraint ({} where it has none): its grammar, in the tool format's tags for
        a call; a 400 naming the field where this server cannot honour it or the schema does not compile."""
        c = req.constraint
        if c is None:
            return {}
        if self.grammars is None:
            raise ApiError(400, f"'{c.field}' needs grammar-constrained decoding, and {self.no_grammar}", c.field)
        if c.call is not None and self.format not in CALL_TAGS:
            raise ApiError(400, f"'{c.field}' forces a tool call, which plait writes in the hermes format only "
                                f"(this server's tool format: {self.format})", c.field)
        answers = ([("", c.json, "")] if c.json is not None else []) + (
            [(CALL_TAGS[self.format][0], c.call, CALL_TAGS[self.format][1])] if c.call is not None else [])
        try:
            return {"grammar": self.grammars.json(answers)}
        except ValueError as err:
            raise ApiError(400, f"'{c.field}': the JSON schema cannot be compiled for constrained decoding: {err}",
                           c.field) from None

    def _keep_rollout_sampling(self, session: Session, req: ChatRequest) -> None:
        asked = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        for key, value in asked.items():
            mine = session.sampling.get(key)
            if value is None or mine is None or float(value) == float(mine):
                continue
            session.overridden.add(key)
            if key not in self.said:
                self.said.add(key)
                print(f"plait: an agent asked for {key}={value} ({session.label}); training samples with the rollout's "
                      f"{key}={mine} (actor_rollout_ref.rollout.{key}: the trainer's log-probs use it), counted in "
                      "agent/sampling_overridden", file=sys.stderr)

    # -- answers ---------------------------------------------------------------------------------

    def read_answer(self, out, req: ChatRequest) -> Choice:
        """The engine's tokens as an API answer: cut at the first stop string (the tokens before it are kept),
        tool calls read in multi_turn.format when the request offered tools; an answer with a call the parser
        cannot read is its text as written, with no calls (finish "stop")."""
        ids, logprobs = list(out.token_ids), list(out.log_probs or [0.0] * len(out.token_ids))
        keep, stop, text = cut_at_stop(self.tokenizer, ids, req.stop)
        ids, logprobs = ids[:keep], logprobs[:keep]
        if text is None:
            text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.eos else ids, skip_special_tokens=False)
        calls, blocks = [], 0
        if req.parse_tools:
            blocks = count_call_blocks(text, self.format)
            content, parsed = parse_tool_calls(text, self.format)
            if len(parsed) == blocks:  # else a call the parser cannot read: the text as written, no calls (as vLLM)
                text, calls = content, [(c.name, c.arguments) for c in parsed]
        for s in self.specials:
            text = text.replace(s, "")
        finish = "tool_calls" if calls else "length" if out.stop_reason == "length" and stop is None else "stop"
        return Choice(ids, logprobs, text, calls, finish, stop, call_blocks=blocks,
                      token_texts=[self.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.logprobs else [])

    def count_tokens(self, req: ChatRequest) -> int:
        return len(self.ct.render(req.messages, True, req.tools))


def grammars_for(engine: str, tokenizer, eos_ids: list[int]) -> tuple[Optional[Grammars], str]:
    """A gateway's `grammars` over `tokenizer` where rollout engine `engine` takes a grammar and llguidance is
    installed, with ""; else None and why not (the engine table's `grammar` entry, or the install hint). Where the
    engine's complete grammar allows the tokenizer's EOS alone (vLLM's), the replayed grammar does too."""
    row = ENGINES[engine]
    why = row.grammar or unavailable()
    return (None, why) if why else (Grammars(tokenizer, [] if row.grammar_tokenizer_eos else eos_ids), "")


def cut_at_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, Optional[str], Optional[str]]:
    """(tokens to keep, the stop string found, the text before it): the tokens wholly before the first stop
    string's start; (all, None, None) when none occurs."""
    if not stops:
        return len(ids), None, None
    text = tokenizer.decode(ids, skip_special_tokens=False)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return len(ids), None, None
    at, stop = min(hits)
    keep = 0
    while keep < len(ids) and len(tokenizer.decode(ids[:keep + 1], skip_special_tokens=False)) <= at:
        keep += 1
    return keep, stop, text[:at]


class _Empty:
    """What a call gets when its chain has no budget left: no tokens, cut by length."""
    token_ids: list = []
    log_probs: list = []
    versions: list = []
    stop_reason = "length"
    started = prefilled = 0.0


_now = time.time
