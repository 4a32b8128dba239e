"""Runs the agent loops of a batch over one engine: per-request generation, batched in rounds.

Each trajectory is a coroutine on an event loop in a thread of its own (tools are awaited there).
When a loop asks for tokens, its request joins the scheduler's queue. The calling thread drives
rounds: it waits until every live trajectory is waiting for tokens (or `grace_s` has passed since
the first one asked, so a slow tool does not hold the others), then decodes all queued requests
as ONE engine batch, each with its own token budget, and hands each its tokens. Trajectories thus
advance at their own speed (one may be in its third turn while another waits on a tool), and each
engine round batches the decode steps of everything that is ready. A request that arrives during
a round waits for the next one (rounds, not per-step admission: the hf engine's decode loop takes
its batch at the start).

Partial rollout (fully_async): `abort()` cuts the running round short; the cut requests keep the
tokens they got (with their log-probs and policy versions) and the call returns, marking
unfinished trajectories "aborted"; their coroutines stay suspended. `resume()` (after new weights
loaded) re-queues the cut requests, which continue from their tokens so far, with the new weights
(and a decoding grammar from its state after those tokens).

With vLLM (`drive_stream`) there are no rounds: vLLM's engine batches continuously, so a request
joins the running batch at the next engine step and is answered the step it finishes.

Left out: priorities, preemption, per-step admission into the hf engine's running decode batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from plait.agents.loop import AgentLoopOutput, TokenOutput

Round = Callable[[list[list[int]], int, dict], Any]  # (prompts, max_new_tokens, sampling) -> Generation


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = field(default_factory=list)      # got so far (a cut request keeps them)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    started: float = 0.0                                  # wall time an engine first took it up
    prefilled: float = 0.0                                # ... and ended its first prefill (0: unknown)

    def key(self) -> tuple:
        return tuple(sorted((k, v) for k, v in self.sampling.items() if k != "max_tokens"))


class Scheduler:
    """The engine as the loops see it (verl's server_manager): `await generate(...)` per turn."""

    def __init__(self, max_tokens: int, expected: int = 0, start_grace_s: float = 0.0):
        """`max_tokens`: a request's budget when its sampling params name none (the response length).
        `expected`: the trajectories of the run; until each has asked once, the run's first round waits for them
        up to `start_grace_s` (outside agents start at their own pace; in-process loops ask at once, so they never
        wait here; later rounds wait `grace_s`, so an agent that never asks delays only the first)."""
        self.max_tokens = max_tokens
        self.cond = threading.Condition()
        self.queue: list[Request] = []
        self.held: list[Request] = []   # cut by an abort, waiting for resume
        self.first_wait: float | None = None
        self.expected, self.start_grace_s, self.submitted, self.rounds = expected, start_grace_s, 0, 0

    async def generate(self, request_id=None, prompt_ids=(), sampling_params=None, **_ignored) -> TokenOutput:
        sampling = dict(sampling_params or {})
        loop = asyncio.get_running_loop()
        budget = min(int(sampling.get("max_tokens") or self.max_tokens), self.max_tokens)
        req = Request(list(prompt_ids), budget, sampling, loop.create_future(), loop)
        with self.cond:
            if not self.queue:
                self.first_wait = time.perf_counter()
            self.queue.append(req)
            self.submitted += 1
            self.cond.notify_all()
        return await req.future

    def take(self, live: Callable[[], int], grace_s: float, stop: Callable[[], bool],
             most: int | None = None) -> list[Request]:
        """Block until a round is worth running; [] when `stop()` (all done, or an abort). `most`: at most that
        many requests a round, the oldest first (a served model's max_num_seqs)."""
        with self.cond:
            while True:
                if stop():
                    return []
                waited = time.perf_counter() - self.first_wait if self.queue else 0.0
                grace = self.start_grace_s if self.rounds == 0 and self.submitted < self.expected else grace_s
                if self.queue and (len(self.queue) >= min(live(), most or live()) or waited >= grace):
                    batch, self.queue = self.queue[:most], self.queue[most:] if most else []
                    if self.queue:
                        self.first_wait = time.perf_counter()
                    self.rounds += 1
                    return batch
                self.cond.wait(timeout=grace_s / 4 if self.queue else 0.05)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


def run_round(requests: list[Request], engine_round: Round, version: int) -> list[Request]:
    """One engine batch per sampling setting; finished requests get their TokenOutput. Returns the ones
    an abort cut short (they keep their tokens so far)."""
    cut = []
    groups: dict[tuple, list[Request]] = {}
    for i, r in enumerate(requests):  # a seeded request alone: its answer must not depend on its batch-mates; a
        # constrained one that an abort cut, too: its grammar goes on from its own tokens so far
        alone = "seed" in r.sampling or (r.tokens and "grammar" in r.sampling)
        groups.setdefault(r.key() + ((i,) if alone else ()), []).append(r)
    now = time.time()
    for r in requests:
        r.started = r.started or now
    for reqs in groups.values():
        budget = [r.max_tokens - len(r.tokens) for r in reqs]
        sampling = reqs[0].sampling
        if reqs[0].tokens and "grammar" in sampling:
            sampling = {**sampling, "grammar": sampling["grammar"].after(reqs[0].tokens)}
        gen = engine_round([r.prompt_ids + r.tokens for r in reqs], max(budget), sampling)
        lengths = gen.response_mask.sum(-1).long().tolist()
        for r in reqs:
            r.prefilled = r.prefilled or gen.prefilled
        for i, (r, room) in enumerate(zip(reqs, budget)):
            n = min(lengths[i], room)
            r.tokens += gen.responses[i, :n].tolist()
            r.logprobs += gen.logprobs[i, :n].float().tolist()
            r.versions += [version] * n
            reason = gen.stop_reasons[i]
            if reason == "aborted" and n < room:
                cut.append(r)
                continue
            reason = "length" if n >= room and reason != "eos" else reason
            out = TokenOutput(token_ids=r.tokens, log_probs=r.logprobs, stop_reason=reason, versions=r.versions,
                              started=r.started, prefilled=r.prefilled)
            r.loop.call_soon_threadsafe(_resolve, r.future, out)
    return cut


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class EventLoopThread:
    """An asyncio loop running forever in a daemon thread (the agent loops and tool awaits live there)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="plait-agent-loops", daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@dataclass
class Run:
    """The trajectories of one generate call."""
    futures: list                   # concurrent.futures.Future of AgentLoopOutput, one per row
    scheduler: Scheduler

    def live(self) -> int:
        return sum(not f.done() for f in self.futures)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


def drive(run: Run, engine_round: Round, version: Callable[[], int], grace_s: float,
          aborted: Callable[[], bool]) -> bool:
    """Run engine rounds until every trajectory is done (False) or an abort cuts in (True): then the
    queued and cut requests are held for `release_held`."""
    sched = run.scheduler
    while True:
        requests = sched.take(run.live, grace_s, lambda: run.done() or aborted())
        cut = run_round(requests, engine_round, version()) if requests else []
        if cut or aborted():
            with sched.cond:
                sched.held, sched.queue = cut + sched.queue, []
            return True
        if not requests:
            return False


def drive_stream(run: Run, serve, version: Callable[[], int], aborted: Callable[[], bool]) -> bool:
    """As `drive`, over an engine with continuous batching (vLLM's `serve`): a request joins the running
    batch at the next engine step and is answered the step it finishes. True when an abort cut in."""
    sched, cut = run.scheduler, []

    def admit():
        with sched.cond:
            reqs, sched.queue = sched.queue, []
        now = time.time()
        for r in reqs:
            r.started = r.started or now
        return [(r, r.prompt_ids + r.tokens, r.sampling, r.max_tokens - len(r.tokens)) for r in reqs]

    def deliver(r: Request, tokens: list[int], logprobs: list[float], reason: str) -> None:
        r.tokens, r.logprobs, r.versions = r.tokens + tokens, r.logprobs + logprobs, r.versions + [version()] * len(tokens)
        if reason == "aborted" and len(r.tokens) < r.max_tokens:
            cut.append(r)
            return
        out = TokenOutput(token_ids=r.tokens, log_probs=r.logprobs, stop_reason=reason, versions=r.versions,
                          started=r.started)
        r.loop.call_soon_threadsafe(_resolve, r.future, out)

    if serve(admit, deliver, lambda: run.done() or aborted()) or cut or aborted():
        with sched.cond:
            sched.held, sched.queue = cut + sched.queue, []
        return True
    return False


def release_held(sched: Scheduler) -> None:
    """resume(): the cut requests rejoin the queue, continuing from their tokens so far."""
    with sched.cond:
        if sched.held:
            sched.queue = sched.held + sched.queue
            sched.first_wait = time.perf_counter()
        sched.held = []
        sched.cond.notify_all()


def outputs(run: Run) -> list[AgentLoopOutput | None]:
    """Finished trajectories' outputs (None: still running); a loop's exception is raised here."""
    return [f.result() if f.done() else None for f in run.futures]
