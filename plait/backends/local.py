"""The local backend: worker groups living in the driver process (the default).

Roles are plain objects; a group calls a method by reference (`group.call(Actor.update, batch)`),
so go-to-definition lands on the worker's code and a renamed method fails at the call site, not
in a string lookup. All roles share the process's one profiler session. The Ray backend
(plait/backends/ray.py) offers the same two calls over Ray actors.
"""

from __future__ import annotations

from typing import Any, Callable

from plait.profiler import ProfilerSession


class LocalWorkerGroup:
    def __init__(self, worker: Any):
        self.worker = worker
        self.world_size = 1

    def call(self, method: Callable, *args, **kwargs) -> Any:
        """Run `method` on every worker; return rank 0's result."""
        return method(self.worker, *args, **kwargs)

    def call_dp(self, method: Callable, batch, *args, **kwargs) -> list[Any]:
        """Split `batch` across the data-parallel workers; one result per rank, in rank order."""
        return [method(self.worker, batch, *args, **kwargs)]

    def recover(self, method: Callable | None = None) -> None:
        """`method` on the worker, to repair what failed in it (Rollout.restart_engine); in one process the
        worker itself is never gone."""
        if method is not None:
            method(self.worker)

    def pipe(self, get: Callable, dst: "LocalWorkerGroup", put: Callable, *args, **kwargs) -> None:
        """`put(dst's worker, get(this worker), *args)`: one process, nothing to move."""
        put(dst.worker, get(self.worker), *args, **kwargs)


class LocalBackend:
    def __init__(self, session: ProfilerSession):
        self.session = session
        self.world_size = 1  # training ranks (perf/throughput is per device): one process

    def spawn(self, role: str, cls: type, *args, **kwargs) -> LocalWorkerGroup:
        return LocalWorkerGroup(cls(*args, profiler=self.session.for_role(role), **kwargs))

    def profile_targets(self) -> list[ProfilerSession]:
        return [self.session]

    def shutdown(self) -> None:
        pass
