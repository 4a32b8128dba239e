"""The worker process of `openai_agent`'s function form: runs the user's agent function, many sessions at once.

    trainer (openai_agent.FunctionAgents) ──stdin: one JSON job a line──▶ this process (own session,
           ◀──protocol fd: one JSON result a line── RLIMIT_AS, ends with the trainer)
    job {"id", "row", "base_url", "api_key"} ──▶ await asyncio.wait_for(run(row, base_url, api_key), timeout)
    result {"id", "score"} | {"id", "failure": "raised ValueError: ..."}

The function is `async def run(row, base_url, api_key)` (a plain function runs in a thread) returning
a number, a dict with "score", or None (no reward: the session's posted reward, else the reward
function). Sessions are coroutines on one event loop, so one process serves a batch of agents waiting
on the model; one that blocks the loop stalls its neighbours until the trainer's time limit kills the
process (each of its sessions then fails with that line). What the agent prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import os
import resource
import sys
import threading


def main(path: str, name: str, timeout: float, memory_limit_mb: int) -> None:
    from plait.data.reward_pool import _exit_with, plain_result
    from plait.safeload import first_line
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the agent's prints must not reach the protocol
    threading.Thread(target=_exit_with(os.getppid()), daemon=True).start()
    if memory_limit_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_mb * 2**20,) * 2)
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
        try:
            value = await asyncio.wait_for(fn(job["row"], job["base_url"], job["api_key"]), timeout)
            answer(job["id"], **_outcome(plain_result(value)))
        except asyncio.TimeoutError:
            answer(job["id"], failure=f"did not return within its timeout ({timeout:g} s)")
        except BaseException as err:  # noqa: BLE001 - SystemExit included: one session fails, not the process
            answer(job["id"], failure=f"raised {type(err).__name__}: {first_line(err)}")

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lambda job=json.loads(line): loop.create_task(one(job)))
        loop.call_soon_threadsafe(loop.stop)  # the trainer closed our stdin
    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()


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
