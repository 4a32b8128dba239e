"""The worker process of `openai_agent`'s function form: runs the user's agent function, many sessions at once.

    trainer (openai_agent.FunctionAgents) ──stdin: one JSON job a line──▶ this process (own session,
           ◀──protocol fd: one JSON result a line── RLIMIT_AS, ends with the trainer)
    job {"id", "row", "base_url", "api_key", "label"} ──▶ await asyncio.wait_for(run(row, base_url, api_key), timeout)
    result {"id", "score"} | {"id", "failure": "raised ValueError: ..."}

The function is `async def run(row, base_url, api_key)` (a plain function runs in a thread) returning
a number, a dict with "score", or None (no reward: the session's posted reward, else the reward
function). Sessions are coroutines on one event loop, so one process serves a batch of agents waiting
on the model; one that blocks the loop stalls its neighbours until the trainer's time limit kills the
process (each of its sessions then fails with that line). What the agent prints (sys.stdout and sys.stderr)
goes to stderr a line at a time, marked with the session that printed it (`\\x1f<label>\\x1f<text>`), which the
trainer shows and logs per session (openai_agent.AgentOutput); what bypasses sys.stdout (a C library, a child
process) goes unmarked.

Sessions share the process, so a library configured process-wide (openai-agents' `set_default_openai_client`,
a module-level client) would send every session's calls with whichever session's key was set last. Each
session therefore runs with its id in a context variable, and every httpx or httpx2 request to the gateway (the
openai and anthropic SDKs and the frameworks on them) carries it in a header (protocol.SESSION_HEADER) that the gateway
trusts over the key. Threads the agent starts itself do not inherit it (asyncio tasks and `to_thread` do):
there, and for HTTP clients other than httpx, the key decides.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import io
import json
import math
import numbers
import os
import resource
import sys
import threading
from typing import Optional

from plait.serving.protocol import SESSION_HEADER


# (session id, the gateway's root URL, the session's label) of the session whose task this is; None outside sessions
SESSION: contextvars.ContextVar[Optional[tuple[str, str, str]]] = contextvars.ContextVar("plait_session", default=None)


def main(path: str, name: str, timeout: float, memory_limit_mb: int) -> None:
    from plait.data.reward_pool import _exit_with, plain_result
    from plait.safeload import first_line
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the agent's prints must not reach the protocol
    printed = sys.stdout = sys.stderr = _SessionLines(sys.__stderr__)
    threading.Thread(target=_exit_with(os.getppid()), daemon=True).start()
    if memory_limit_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_mb * 2**20,) * 2)
    _tag_gateway_calls()  # before the agent's module imports its libraries
    try:
        fn, error = _load(path, name), None
    except BaseException as err:  # noqa: BLE001 - every job is answered with this line
        fn, error = None, f"could not be loaded from {path}: {type(err).__name__}: {first_line(err)}"
    loop = asyncio.new_event_loop()
    write_lock = threading.Lock()

    def answer(job_id, **result) -> None:
        line = json.dumps({"id": job_id, **result})
        with write_lock:
            channel.write(line + "\n")

    async def one(job: dict) -> None:
        if error is not None:
            return answer(job["id"], failure=error)
        SESSION.set((job["api_key"], job["base_url"].split("/sessions/")[0], job["label"]))  # this task's own context
        try:
            value = await asyncio.wait_for(fn(job["row"], job["base_url"], job["api_key"]), timeout)
            answer(job["id"], **_outcome(plain_result(value)))
        except asyncio.TimeoutError:
            answer(job["id"], failure=f"did not return within its timeout ({timeout:g} s)")
        except BaseException as err:  # noqa: BLE001 - SystemExit included: one session fails, not the process
            answer(job["id"], failure=f"raised {type(err).__name__}: {first_line(err)}")
        finally:
            printed.end(job["label"])

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lambda job=json.loads(line): loop.create_task(one(job)))
        loop.call_soon_threadsafe(loop.stop)  # the trainer closed our stdin
    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()


def _tag_gateway_calls() -> None:
    """Every httpx (or httpx2: the openai and anthropic SDKs) request to the gateway from a session's context
    carries that session's id."""
    import importlib
    for package in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for cls in (module.Client, module.AsyncClient):
            def send(self, request, *args, _send=cls.send, **kwargs):  # the async one's coroutine is returned as is
                tag = SESSION.get()
                if tag is not None and str(request.url).startswith(tag[1]):
                    request.headers[SESSION_HEADER] = tag[0]
                return _send(self, request, *args, **kwargs)
            cls.send = send


class _SessionLines(io.TextIOBase):
    """sys.stdout and sys.stderr of the worker: whole lines to `out`, each marked with the session that wrote it."""

    def __init__(self, out):
        self.out, self.partial, self.lock = out, {}, threading.Lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # what writes past us (faulthandler, a child process) lands unmarked on stderr
        return self.out.fileno()

    @property
    def encoding(self) -> str:
        return self.out.encoding

    def write(self, text: str) -> int:
        tag = SESSION.get()
        label = "" if tag is None else tag[2]
        with self.lock:
            *lines, rest = (self.partial.pop(label, "") + text).split("\n")
            self.partial[label] = rest[-65536:]  # bounded, whatever it writes without a newline
            for line in lines:
                self.out.write(f"\x1f{label}\x1f{line}\n")
            self.out.flush()
        return len(text)

    def end(self, label: str) -> None:
        """The session ended: its unfinished line, if any."""
        with self.lock:
            rest = self.partial.pop(label, "")
            if rest:
                self.out.write(f"\x1f{label}\x1f{rest}\n")
                self.out.flush()


def _outcome(value) -> dict:
    if value is None:
        return {"score": None}
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return {"score": float(value)}
    return {"failure": f"returned {str(value)[:60]!r}; an agent returns a finite number, a dict with 'score', or None"}


def _load(path: str, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"plait_agent_{os.path.splitext(os.path.basename(path))[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} has no function {name!r} (actor_rollout_ref.rollout.agent.openai_agent.name)")
    if not inspect.iscoroutinefunction(fn):
        sync = fn

        async def fn(row, base_url, api_key):  # a plain function: in a thread, so the loop serves the others
            return await asyncio.to_thread(sync, row, base_url, api_key)
    return fn


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
