"""Which steps open and close a profiling window, and when the finish hook is due. Pure, no torch.

    steps [2, 3, 5, 12], last_step 10
      continuous:      windows (2, 3), (5, 5)           hook after step 5
      not continuous:  windows (2, 2), (3, 3), (5, 5)   hook after step 5
      warning: "global_profiler.steps 12 is beyond the run's last step 10 and will not be profiled"

torch_memory's and memray's `memory_snapshot_num_steps` N makes every N windows one (verl: one snapshot per N
profiled steps): steps [1, 3, 5], N=2 gives windows (1, 3) and (5, 5), recording step 2 as well, as
verl's always-on history does.

Steps past the run are dropped with one warning line, so a window never reaches past `last_step`
and the hook never waits for a step that will not come. The failure path (a step raises, or the
run stops early) is not planned here: `StepProfiler.close` closes whatever window is open, marks
it incomplete and runs the hook if any window opened. A run in which no window ever opened runs
no hook: there is nothing for it to collect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class Window:
    first: int
    last: int

    def __contains__(self, step: int) -> bool:
        return self.first <= step <= self.last


@dataclass(frozen=True)
class ProfilePlan:
    windows: tuple[Window, ...]
    warning: Optional[str] = None   # one line about steps beyond the run, or None

    def window_of(self, step: int) -> Optional[Window]:
        return next((w for w in self.windows if step in w), None)

    def opens(self, step: int) -> Optional[Window]:
        """The window that opens before `step`, if any."""
        w = self.window_of(step)
        return w if w is not None and w.first == step else None

    def closes(self, step: int) -> Optional[Window]:
        """The window that closes after `step`, if any."""
        w = self.window_of(step)
        return w if w is not None and w.last == step else None

    @property
    def hook_step(self) -> Optional[int]:
        """The step after which the finish hook runs on a run that does not fail."""
        return self.windows[-1].last if self.windows else None


def plan(steps: Iterable[int], last_step: int, continuous: bool, per_window: int = 1) -> ProfilePlan:
    listed = sorted(set(steps))
    reachable = [s for s in listed if s <= last_step]
    beyond = [s for s in listed if s > last_step]
    warning = None
    if beyond:
        warning = (f"global_profiler.steps {', '.join(map(str, beyond))} "
                   f"{'is' if len(beyond) == 1 else 'are'} beyond the run's last step {last_step} "
                   "and will not be profiled")
    windows: list[Window] = []
    for s in reachable:
        if continuous and windows and windows[-1].last == s - 1:
            windows[-1] = Window(windows[-1].first, s)
        else:
            windows.append(Window(s, s))
    groups = [windows[i:i + per_window] for i in range(0, len(windows), per_window)]
    return ProfilePlan(tuple(Window(g[0].first, g[-1].last) for g in groups), warning)
