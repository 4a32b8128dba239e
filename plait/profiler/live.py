"""The live report: `<output dir>/report` rewritten every `global_profiler.report_freq` steps while the run
trains, verdict included, without taking the steps' time.

    lifecycle:  live = LiveReport(output_dir, freq)
                live.step(N)      after step N's records are written: a refresh if due and none running
                live.close()      after the run's summary.json: one last refresh, waited for

A refresh is `plait profile report <output dir> --no-merge` in a child process at the lowest CPU priority
(nice 19): the page and verdict.json from the run's files, no merged traces. At most one runs at a time;
a step that finds the last one still running skips its turn, so a slow report never queues up behind the
run. Its cost to the steps is measured by bench/bench_live_report.py. The health alarms a finished refresh
found (verdict.json's "alarms", profiler/analysis/alarms.py) are said on the console during the run, each
(rule, stage, rank) once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Optional

FINAL_TIMEOUT_S = 600.0


class LiveReport:
    def __init__(self, output_dir: str, freq: int, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)):
        self.output_dir, self.freq, self.say = output_dir, freq, say
        self.child: Optional[subprocess.Popen] = None
        self.started = self.skipped = 0
        self.raised: set[tuple] = set()  # the alarms said so far: (rule, stage, rank)

    def step(self, step: int) -> None:
        if self.freq <= 0 or step % self.freq:
            return
        if self.child is not None and self.child.poll() is None:
            self.skipped += 1
            return
        if self.child is not None:
            self.raise_alarms()
        self._start()

    def raise_alarms(self) -> None:
        """Say the alarms of the last finished refresh that were not said yet (its report/verdict.json)."""
        try:
            with open(os.path.join(self.output_dir, "report", "verdict.json")) as f:
                found = {(a["rule"], a["stage"], a["rank"]): a["line"] for a in json.load(f)["alarms"]}
        except (OSError, ValueError, KeyError, TypeError):  # no refresh finished yet, or one that failed
            return
        for name, line in found.items():
            if name not in self.raised:
                self.raised.add(name)
                self.say(f"plait: alarm (live report): {line}")

    def close(self, final: bool = True) -> None:
        """The last refresh, after the run's summary is written (waited for, so the page is the run's last);
        without `final` (the run failed) none: a refresh still running finishes on its own."""
        if self.freq <= 0 or not final:
            return
        if self.child is not None:
            self.child.wait()
        self._start()
        try:
            self.child.wait(FINAL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()

    def _start(self) -> None:
        self.started += 1
        log = open(os.path.join(self.output_dir, "report_live.log"), "a")
        self.child = subprocess.Popen([sys.executable, "-m", "plait.cli", "profile", "report", self.output_dir, "--no-merge"],
                                      stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=_low_priority,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
        log.close()


def _low_priority() -> None:
    os.nice(19)
