"""`openai_agent`: a row's rollout made by an agent that lives outside plait, through the gateway.

    row ──▶ OpenAIAgentLoop.run ──opens──▶ Session (plait/serving/sessions.py)
              │ starts the agent:                        ▲ each call: /sessions/{id}/v1/chat/completions
              │  function: run(row, base_url, api_key)   │ (or /v1/messages, or the id as API key),
              │    in a worker process (agent_process.py)│ tokenised by the session, sampled by this
              │  command: a process per row, with        │ rollout's engine queue like any agent loop's turn
              │    OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, the row as JSON on stdin
              ▼ awaits its end (timeout: killed with its process group)
           the session's chains as trajectories; the reward: what the function returned, else what the
           agent posted to /sessions/{id}/reward, else the reward function on the final chain

The gateway (plait/serving/server.py) runs on the rollout worker's agent-loop thread, one per worker,
started with the first session; agents reach it on 127.0.0.1 (`openai_agent.host`), Ray workers
included (the agents are the worker's own children). An agent that raises, times out, exits non-zero
or never calls the model costs its own sample: its tokens are masked out of the loss, it stays out of
its group's baseline, and the trainer names it (agent/failed_sessions).

What an agent prints (stdout and stderr, both forms) reaches the user's stderr a line at a time, prefixed with its
session (`[agent row 12/3fa2b1] ...`), at most SHOWN_PER_SESSION lines a session and SHOWN_PER_STEP a generate
call (the rest counted in one line); every line also goes to agents.log in the run's output directory (at most
LOGGED_PER_SESSION a session).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from plait.agents.loop import AgentLoopBase, AgentLoopOutput, output_of, register
from plait import reaper
from plait.agents.tokens import Trajectory
from plait.profiler.samples import add_span, now
from plait.reaper import reaped_argv
from plait.safeload import first_line
from plait.serving.gateway import Gateway, grammars_for
from plait.serving.server import Server

GRACE_S = 30.0  # past an agent's own timeout, how long its worker process may take to say so before it is killed
SHOWN_PER_SESSION, SHOWN_PER_STEP, LOGGED_PER_SESSION, LINE_CHARS = 20, 200, 2000, 1000


@dataclass
class Outcome:
    score: Optional[float] = None
    failure: Optional[str] = None


class ExternalAgents:
    """The gateway of one rollout worker and the agents it starts (function workers or commands)."""

    def __init__(self, cfg, tokenizer, model_type: Optional[str], eos_ids: list[int], loop: asyncio.AbstractEventLoop):
        self.cfg = cfg.actor_rollout_ref.rollout.agent.openai_agent
        self.name = self.cfg.path and f"{self.cfg.path}:{self.cfg.name}" or self.cfg.command
        model = os.path.basename(str(cfg.actor_rollout_ref.model.path or "plait").rstrip("/")) or "plait"
        grammars, no_grammar = grammars_for(cfg.actor_rollout_ref.rollout.name, tokenizer, eos_ids)
        self.gateway = Gateway(tokenizer, model_type, cfg.actor_rollout_ref.rollout.multi_turn.format, eos_ids, model,
                               grammars=grammars, no_grammar=no_grammar)
        self.output = AgentOutput(os.path.join(cfg.output_dir, "agents.log"))
        self.server = Server(self.gateway, loop, self.cfg.host, self.cfg.port)
        self.memory_limit_mb = self.cfg.memory_limit_mb or cfg.reward.memory_limit_mb or 0
        self.functions = None if not self.cfg.path else FunctionAgents(
            self.cfg.path, self.cfg.name, self.cfg.num_workers, self.cfg.timeout, self.memory_limit_mb, self.output)
        self.commands: set[int] = set()  # guardians of the command agents running now (plait/reaper.py)

    async def run(self, row: dict, session) -> Outcome:
        base, label = f"{self.server.url}/sessions/{session.id}", f"{session.label}/{session.id[:6]}"
        if self.functions is not None:
            return await self.functions.run(row, base + "/v1", session.id, label)
        env = {**os.environ, "OPENAI_BASE_URL": base + "/v1", "OPENAI_API_KEY": session.id,
               "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": session.id, "PLAIT_SESSION_ID": session.id,
               "PLAIT_REWARD_URL": base + "/reward", "PLAIT_MODEL": self.gateway.model_name}
        return await run_command(self.cfg.command, row, env, self.cfg.timeout, self.memory_limit_mb, self.commands,
                                 lambda text: self.output.line(label, text))

    def close(self) -> None:
        """Kill the agents still running (a rollout given up at the run's end), then stop the server."""
        if self.functions is not None:
            self.functions.close()
        for pid in list(self.commands):
            reaper.stop(pid)  # the guardian kills the command's whole tree
        self.server.close()
        self.output.close()


class AgentOutput:
    """Where the agents' printed lines go: the user's stderr (bounded) and agents.log (see the module docstring)."""

    def __init__(self, path: str):
        self.path, self.file = path, None
        self.shown: collections.Counter = collections.Counter()   # this step's lines on stderr, per session
        self.logged: collections.Counter = collections.Counter()  # lines in agents.log, per session
        self.held = 0                                             # this step's lines not shown

    def line(self, label: str, text: str) -> None:
        text = text[:LINE_CHARS]
        if self.logged[label] < LOGGED_PER_SESSION:
            if self.file is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self.file = open(self.path, "a", buffering=1)
            self.logged[label] += 1
            cut = "" if self.logged[label] < LOGGED_PER_SESSION else f" [its later lines are not logged: " \
                                                                        f"{LOGGED_PER_SESSION} a session]"
            self.file.write(f"{label}: {text}{cut}\n")
        if self.shown[label] < SHOWN_PER_SESSION and sum(self.shown.values()) < SHOWN_PER_STEP:
            self.shown[label] += 1
            print(f"[agent {label}] {text}", file=sys.stderr)
        else:
            self.held += 1

    def end_step(self) -> None:
        """Say how many lines of this generate call were not shown; the next one starts afresh."""
        if self.held:
            print(f"plait: the agents printed {self.held} more lines than shown (at most {SHOWN_PER_SESSION} a session "
                  f"and {SHOWN_PER_STEP} a step on stderr); agents.log holds them: {self.path}", file=sys.stderr)
        self.shown.clear()
        self.held = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@register("openai_agent")
class OpenAIAgentLoop(AgentLoopBase):
    """One session per row sample; the agent is `rollout.agent.openai_agent` (path + name, or command)."""

    def __init__(self, *args, external: Optional[ExternalAgents] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if external is None:
            raise ValueError("openai_agent runs in plait's rollout worker, which gives it the gateway")
        self.external = external

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        label = f"row {kwargs.get('index')}"
        gateway = self.external.gateway
        session = gateway.open(label, self.server_manager.generate, sampling_params, self.prompt_length,
                               self.response_length)
        try:
            outcome = await self.external.run(agent_row(kwargs), session)
        except Exception as err:  # noqa: BLE001 - starting it failed (no such command, fork refused): this session's
            outcome = Outcome(failure=f"could not be started: {type(err).__name__}: {first_line(err)}")
        finally:
            gateway.close(session.id)
        try:  # off the gateway's event loop: a few microseconds a constrained token (docs/agents.md)
            grammar = await asyncio.to_thread(session.grammar_masks, self.response_length)
        except ValueError as err:  # the engine sampled a token its grammar does not allow: never trained
            grammar = err
        return session_output(session, outcome, self.ct, kwargs["raw_prompt"], self.prompt_length, self.response_length,
                              f"agent {self.external.name} ({label})", grammar)


def agent_row(kwargs: dict) -> dict:
    """What the agent gets of its row: the prompt's messages and what scores it (JSON-safe)."""
    row = {"messages": kwargs["raw_prompt"], "data_source": kwargs.get("data_source"),
           "ground_truth": (kwargs.get("reward_model") or {}).get("ground_truth"),
           "extra_info": kwargs.get("extra_info") or {}, "index": kwargs.get("index")}
    return json.loads(json.dumps(row, default=_plain))


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else str(value)


def session_output(session, outcome: Outcome, ct, messages: list[dict], prompt_length: int, response_length: int,
                   who: str, grammar: list[dict] | ValueError = ()) -> AgentLoopOutput:
    """The session's final chain as the row's output, its earlier chains in extra_fields["chains"]. A failed
    session's tokens are masked out of the loss (an empty response when it sampled none). An agent that fails
    after the chain's response budget (data.max_response_length) cut an answer has not failed its sample: the
    budget ended the episode (openai-agents raises on the cut Response), so the sample is trained as truncated,
    scored by the session's posted reward or the reward function, and counted (agent/failed_after_cut).
    `grammar`: per chain, its replayed grammar masks (plait/workers/grammar.py masks), or the replay's error: a
    token sampled off its grammar fails the session."""
    chains = session.trajectories()
    failure = outcome.failure or (None if chains else "never called the model")
    after_cut = failure if failure is not None and chains and session.cut else None
    failure = None if after_cut else failure
    if isinstance(grammar, ValueError):
        failure, after_cut, grammar = f"was sampled off its decoding grammar: {grammar}", None, ()
    if failure is not None:
        for t in chains:
            t.mask = [0] * len(t.mask)
    if not chains:
        try:
            chains = [ct.initial(messages, None, prompt_length)]
        except Exception:  # noqa: BLE001 - the prompt does not render: a one-token stand-in, trained on nothing
            chains = [Trajectory(ids=[0])]
    reward = outcome.score if outcome.score is not None else session.reward
    generating = sum(s.finished - s.submitted for s in session.spans)
    spans = [(s.submitted, s.started, s.prefilled, s.finished) for s in session.spans]
    info = {"id": session.id, "failure": None if failure is None else f"{who} {failure}", "chains": len(chains),
            "requests": len(session.spans), "sampling_overridden": len(session.overridden),
            "unparsed_tool_calls": session.unparsed, "failed_after_cut": after_cut,
            "constrained_tokens": sum(t.mask[c] for t, g in zip(chains, grammar) if g for c in g["cols"].tolist()),
            "agent_s": max(0.0, time.time() - session.opened - generating), "spans": spans}
    outs = []
    for i, t in enumerate(chains):
        final = i == len(chains) - 1
        metrics = {"generate_sequences": generating} if final else {}
        session_spans(metrics, session)  # every chain of a session is one of its samples: the session's spans
        calls = {"tool_call_attempts": session.call_blocks, "tool_calls_made": session.calls} if final else {}
        out = output_of(t, response_length, session.replies() + 1, metrics,
                        {"turn_scores": [], "tool_rewards": [], **calls, "session": {**info, "final": final}})
        out.reward_score, out.response_grammar = reward, grammar[i] if grammar else None
        outs.append(out)
    outs[-1].extra_fields["chains"] = outs[:-1]
    return outs[-1]


def session_spans(metrics: dict, session) -> None:
    """The session's per-sample spans (samples.jsonl, profiler/samples.py), on each of its chains: per call
    `request_queue` (waiting for an engine round), `prefill` and `decode` (one `gen` where the engine does not
    say when its prefill ended), each with attrs.call; `agent` for the agent's own time before, between and
    after its calls (its tools, its framework, its reward)."""
    shift = now() - time.time()  # the gateway's spans are wall-clock seconds; samples.jsonl's clock is now()
    last = session.opened
    for call, s in enumerate(sorted(session.spans, key=lambda s: s.submitted), 1):
        if s.submitted > last:
            add_span(metrics, "agent", last + shift, s.submitted + shift)
        add_span(metrics, "request_queue", s.submitted + shift, s.started + shift, call=call)
        if s.prefilled:
            add_span(metrics, "prefill", s.started + shift, s.prefilled + shift, call=call)
            add_span(metrics, "decode", s.prefilled + shift, s.finished + shift, call=call, tokens=s.tokens)
        else:
            add_span(metrics, "gen", s.started + shift, s.finished + shift, call=call, tokens=s.tokens)
        last = max(last, s.finished)
    add_span(metrics, "agent", last + shift, now())


# -- the function form ---------------------------------------------------------------------------

class FunctionAgents:
    """`num_workers` processes running the user's agent function, sessions spread over them."""

    def __init__(self, path: str, name: str, num_workers: int, timeout: float, memory_limit_mb: int,
                 output: AgentOutput):
        self.args = [sys.executable, "-m", "plait.agents.agent_process", path, name, str(timeout), str(memory_limit_mb)]
        self.timeout, self.output = timeout, output
        self.workers: list[Optional[_AgentProcess]] = [None] * num_workers

    async def run(self, row: dict, base_url: str, api_key: str, label: str) -> Outcome:
        i = min(range(len(self.workers)), key=lambda k: -1 if self.workers[k] is None else len(self.workers[k].pending))
        if self.workers[i] is None or self.workers[i].dead:
            self.workers[i] = _AgentProcess(self.args, self.output)
        return await self.workers[i].submit({"row": row, "base_url": base_url, "api_key": api_key, "label": label},
                                            self.timeout + GRACE_S)

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.kill()


class _AgentProcess:
    def __init__(self, args: list[str], output: AgentOutput):
        self.args, self.proc, self.dead, self.output = args, None, False, output
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.started = asyncio.ensure_future(self._start())  # sessions given to it meanwhile wait for it

    async def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this plait, in the child too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = await asyncio.create_subprocess_exec(*reaped_argv(self.args), stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                         start_new_session=True, env=env, limit=2**24)
        asyncio.get_running_loop().create_task(self._read())
        asyncio.get_running_loop().create_task(_lines(self.proc.stderr, self._printed))

    async def submit(self, job: dict, deadline: float) -> Outcome:
        job_id, self.next_id = self.next_id, self.next_id + 1
        future = asyncio.get_running_loop().create_future()
        self.pending[job_id] = future
        try:
            await self.started
            self.proc.stdin.write((json.dumps({"id": job_id, **job}) + "\n").encode())
            await self.proc.stdin.drain()
            return await asyncio.wait_for(asyncio.shield(future), deadline)
        except asyncio.TimeoutError:
            self.kill()  # its event loop is blocked: the process's other sessions fail with it
            return Outcome(failure=f"did not answer within {deadline:g} s (its worker process was killed)")
        except (BrokenPipeError, ConnectionResetError):
            return await future  # the reader answers it with the process's death
        finally:
            self.pending.pop(job_id, None)

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            future = self.pending.get(msg.get("id"))
            if future is not None and not future.done():
                future.set_result(Outcome(score=msg.get("score"), failure=msg.get("failure")))
        code = await self.proc.wait()
        self.dead = True
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        said = f": {self.stderr[-1]}" if self.stderr else ""
        for future in self.pending.values():
            if not future.done():
                future.set_result(Outcome(failure=f"its worker process {how}{said}"))

    def _printed(self, line: str) -> None:
        """A line of the worker's stderr: `\\x1f<label>\\x1f<text>` where a session printed it (agent_process.py)."""
        label, text = "", line  # unmarked: written past sys.stdout (a C library, a child process)
        if line.startswith("\x1f") and line.count("\x1f") >= 2:
            _, label, text = line.split("\x1f", 2)
        if text.strip():
            self.stderr.append(text.strip()[:300])
            self.output.line(label or "worker", text)

    def kill(self) -> None:
        """The worker and everything it started (its guardian ends the tree: plait/reaper.py)."""
        self.dead = True
        if self.proc is not None and self.proc.returncode is None:
            reaper.stop(self.proc.pid)


# -- the command form ----------------------------------------------------------------------------

async def run_command(command: str, row: dict, env: dict, timeout: float, memory_limit_mb: int,
                      running: set[int], printed: Callable[[str], None]) -> Outcome:
    """The command in a shell under a guardian (plait/reaper.py: whatever it starts, setsid and double forks
    included, ends with it), the row as JSON on stdin; killed at `timeout`. `running` holds the guardian's pid
    while it runs; `printed` gets each line of its stdout and stderr."""
    def limits():
        if memory_limit_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_mb * 2**20,) * 2)
    proc = await asyncio.create_subprocess_exec(*reaped_argv(["/bin/sh", "-c", command]), stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                start_new_session=True, env=env, preexec_fn=limits)
    running.add(proc.pid)
    tail: collections.deque[str] = collections.deque(maxlen=20)

    def err(text: str) -> None:
        tail.append(text.strip()[:300])
        printed(text)
    readers = [asyncio.get_running_loop().create_task(_lines(proc.stdout, printed)),
               asyncio.get_running_loop().create_task(_lines(proc.stderr, err))]
    try:
        proc.stdin.write(json.dumps(row).encode() + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # it did not read its row: its exit status says how it went
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        await _end(proc)
        return Outcome(failure=f"did not finish within its timeout ({timeout:g} s); it and what it started were killed")
    finally:
        await _end(proc)  # what it left running
        running.discard(proc.pid)
        await asyncio.wait(readers, timeout=1)
    if code != 0:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return Outcome(failure=how + (f": {tail[-1]}" if tail else ""))
    return Outcome()


async def _end(proc) -> None:
    """A guardian's whole tree, then the guardian (its group at once if it does not answer in 10 s)."""
    reaper.stop(proc.pid)
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:
        _killpg(proc.pid)
        await proc.wait()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


async def _lines(stream, each: Callable[[str], None]) -> None:
    """Read a stream to its end, calling `each` with every non-blank line, right-stripped (a line without an end in
    its 64 KiB keeps its last 4 KiB: bounded, whatever it writes)."""
    rest = b""
    while chunk := await stream.read(1 << 16):
        *lines, rest = (rest + chunk).split(b"\n")
        rest = rest[-4096:]
        for line in lines:
            if text := line.decode(errors="replace").rstrip():
                each(text)
    if text := rest.decode(errors="replace").rstrip():
        each(text)
