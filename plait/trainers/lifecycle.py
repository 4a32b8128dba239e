"""THE step lifecycle: the one loop every trainer mode runs.

    resume ─▶ start ─▶ [validate] ─▶ for step N in start..last:
                                       profiler.begin_step(N)        window opens if scheduled
                                       trainer.train_step(N, timer)  the mode's stages, timed
                                       validate every test_freq      (inside the step window)
                                       checkpoint every save_freq    (inside the step window)
                                       profiler.end_step(N)          window closes if scheduled
                                       log metrics (console, metrics.jsonl, TensorBoard, W&B)
                                       TIMELINE.flush(N)             the step's spans: timeline.jsonl
             finally ─▶ profiler.close(error) ─▶ trainer.close() ─▶ loggers closed ─▶ summary.json

Everything step-keyed — profiler windows, timing metrics, checkpoints, validation, logging — is
here and nowhere else, so every mode gets it identically from step 1. A trainer mode supplies
only the `Trainer` protocol below: what one step does, how to validate, what its state is.
Step N produces policy version N; steps are numbered from 1. How a checkpoint is written, verified,
resumed and set aside is plait/trainers/checkpoint.py; the run's summary is summary.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol, Sequence

from plait.errors import Interrupted, RunError
from plait.profiler import StepProfiler
from plait.profiler.live import LiveReport
from plait.profiler.naming import write_location
from plait.profiler.samples import SAMPLES, SAMPLES_FILE
from plait.profiler.timeline import TIMELINE, TIMELINE_FILE, StagePeaks, fold_peaks, stage_memory_metrics
from plait.trainers.checkpoint import STEP_METRICS, Checkpoints, verify_checkpoint
from plait.trainers.summary import RunClock, summarise_run


class StageTimer:
    """Wall time (`timing_s/<stage>`) and peak memory (`memory/<stage>/*`) per named stage of one
    step, each stage also a span of the timeline (role "trainer", the step's policy version)."""

    def __init__(self, version: int = 0):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, dict[str, int]] = {}
        self.version = version
        self._memory = StagePeaks()

    @contextlib.contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        self._memory.enter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.times[name] = self.times.get(name, 0.0) + end - start
            fold_peaks(self.peaks.setdefault(name, {}), self._memory.exit())
            TIMELINE.add("trainer", name, start, end, self.version)


@dataclass
class StepResult:
    metrics: dict[str, float]
    num_tokens: int = 0                  # prompt + response tokens trained on (throughput)
    response_tokens: int = 0             # generated tokens (per-token generation time)


class Trainer(Protocol):
    version: int                                     # policy version the rollout generates with

    def total_steps(self) -> int: ...
    def start(self) -> None: ...
    def train_step(self, step: int, timer: StageTimer) -> StepResult: ...
    def validate(self) -> dict[str, float]: ...
    def save_checkpoint(self, path: str, step: int) -> None: ...
    def load_checkpoint(self, path: str, step: int) -> None: ...
    def profile_targets(self) -> Sequence: ...
    def held(self) -> ContextManager: ...             # no generation on another thread inside (a window's start, stop)
    def close(self) -> None: ...


@dataclass
class LifecycleConfig:
    output_dir: str
    test_freq: int = -1
    save_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = None
    n_devices: int = 1                       # the backend's training ranks: perf/throughput is per device
    run_config: Optional[dict] = None        # the resolved config tree: saved in each checkpoint, compared on resume
    allow_config_change: bool = False        # trainer.resume_allow_config_change
    val_only: bool = False                   # trainer.val_only: validate the (resumed) policy, then stop
    checkpoint_callback: Optional[object] = None  # trainer.checkpoint_callback_class's object (its on_save)


class Lifecycle:
    def __init__(self, cfg: LifecycleConfig, trainer: Trainer, profiler_cfg, tracker,
                 shutdown: Callable[[], None] = lambda: None, started: Optional[float] = None):
        self.cfg, self.trainer, self.profiler_cfg, self.tracker = cfg, trainer, profiler_cfg, tracker
        self.shutdown = shutdown  # the backend's: worker processes and a Ray instance plait started
        self.checkpoints = Checkpoints(cfg, trainer)
        self.clock = RunClock(started)  # from build's start, so start-up counts model and worker set-up
        self.stop = StopRequest()
        self.saved = 0  # the step of the newest checkpoint this run wrote
        self.live = LiveReport(cfg.output_dir, profiler_cfg.report_freq, tracker.note)  # report/ rewritten while it trains

    def run(self) -> dict[str, float]:
        """Train to the last step; returns the last step's metrics."""
        last = self.trainer.total_steps()
        profiler = StepProfiler(self.profiler_cfg, last, self.trainer.profile_targets(), self.tracker.note,
                                self.trainer.held)
        metrics: dict[str, float] = {}
        error: BaseException | None = None
        step = start = 0
        TIMELINE.open(os.path.join(self.cfg.output_dir, TIMELINE_FILE))
        if self.profiler_cfg.samples:  # per-sample spans (profiler/samples.py); unopened, the log writes nothing
            SAMPLES.open(os.path.join(self.cfg.output_dir, SAMPLES_FILE))
        try:
            with signals_as_interrupt(self.stop):
                start = self._restart(last, profiler)
                self.trainer.start()
                self.clock.parts["startup"] = self.clock.elapsed()
                if self.cfg.val_only:  # verl's: validation before training, and no training
                    with self.clock.part("validation"):
                        metrics = self.trainer.validate()
                        self.tracker.log(metrics, step=start - 1)
                    return metrics
                if self.cfg.val_before_train and start == 1 and self.cfg.test_freq != -1:
                    with self.clock.part("validation"):
                        self.tracker.log(self.trainer.validate(), step=0)
                for step in self.tracker.progress(range(start, last + 1), total=last, initial=start - 1):
                    if self.stop.requested:  # preempted between steps (or at start): the newest checkpoint stands
                        print(f"plait: stopped on SIGTERM before step {step}; the newest checkpoint stands",
                              file=sys.stderr)
                        break
                    metrics = self._step(step, last, profiler)
                    if self.stop.requested:
                        self._stopped_after(step, metrics)
                        break
        except BaseException as err:
            error = err
            raise
        finally:
            profiler.close(error)
            self.trainer.close()
            TIMELINE.close(step)  # the rollouter's last spans, after it stopped
            SAMPLES.close(step)
            self.tracker.close()
            self.shutdown()
            self._summarise(start, last, profiler, error)
            self.live.close(final=error is None)  # after a failure the error is the last word, not a report
        return metrics

    def _restart(self, last: int, profiler: StepProfiler) -> int:
        """Resume (or start fresh) and bring the run's logs to the step before the first one to run;
        say in one line when that leaves nothing to do, or listed profile steps behind."""
        start, path = self.checkpoints.resume()
        if start > last:
            print(f"plait: nothing to do: resumed after step {start - 1} and the run's last step is {last} "
                  "(trainer.total_training_steps); raise it, or start afresh with trainer.resume_mode=disable "
                  "or a new trainer.experiment_name", file=sys.stderr)
        profiler.note_start(start)
        self.checkpoints.set_aside(start, self.tracker.path, self.profiler_cfg.save_path)
        if self.profiler_cfg.save_path:
            write_location(self.cfg.output_dir, self.profiler_cfg.save_path, self.profiler_cfg.tool)
        # metrics.jsonl ends at the checkpoint's step (its record restored if this run's line was
        # lost; not for a checkpoint of another output dir); a fresh start drops an old step 0 too
        own = self.checkpoints.is_own(path)
        self.tracker.keep_until(start - 1 if start > 1 else -1, os.path.join(path, STEP_METRICS) if own else "")
        TIMELINE.truncate_after(start - 1)
        SAMPLES.truncate_after(start - 1)
        return start

    def _step(self, step: int, last: int, profiler: StepProfiler) -> dict[str, float]:
        timer = StageTimer(self.trainer.version)
        profiler.begin_step(step, version=self.trainer.version)
        with timer.stage("step"):
            result = self.trainer.train_step(step, timer)
            metrics = dict(result.metrics)
            if _due(step, self.cfg.test_freq, last):
                with timer.stage("testing"):
                    metrics.update(self.trainer.validate())
            if _due(step, self.cfg.save_freq, last) or self.stop.requested:  # SIGTERM: this step's checkpoint
                with timer.stage("save_checkpoint"):
                    self.checkpoints.save(step, self._record(step, metrics, timer, result))
                    self.saved = step
        profiler.end_step(step)
        with TIMELINE.span("trainer", "log", self.trainer.version):  # between steps: a span, so no time is unnamed
            record = self._record(step, metrics, timer, result)
            self.tracker.log(record, step=step)
        TIMELINE.flush(step)
        SAMPLES.flush(step)
        self.live.step(step)
        return record

    def _stopped_after(self, step: int, record: dict) -> None:
        """SIGTERM (preemption) arrived during `step`, which finished: its checkpoint written (unless the step
        saved it already) and verified, then one line; the run then ends as a finished one does (exit 0)."""
        if self.saved != step:  # the signal came after the step's save point
            self.checkpoints.save(step, record)
            self.saved = step
        path = os.path.join(self.checkpoints.dir, f"global_step_{step}")
        problem = verify_checkpoint(path)
        if problem:
            raise RunError(f"stopping on SIGTERM: the checkpoint of step {step} ({path}) does not verify: {problem}")
        print(f"plait: stopped on SIGTERM after step {step}: {path} written and verified; the same command resumes "
              f"from step {step + 1}", file=sys.stderr)

    def _record(self, step: int, metrics: dict, timer: StageTimer, result: StepResult) -> dict[str, float]:
        out = {**metrics, **timing_metrics(timer.times, result, self.cfg.n_devices), **stage_memory_metrics(timer.peaks)}
        out.update(TIMELINE.rank_metrics())  # ranks/<role>/<stage>/*: Ray workers' own spans of this step
        out["training/global_step"] = step
        out["training/policy_version"] = self.trainer.version
        return out

    def _summarise(self, start: int, last: int, profiler: StepProfiler, error: BaseException | None) -> None:
        """summary.json in the output dir, and the console lines unless the run failed (its error is the last word)."""
        status = ("preempted" if self.stop.requested else "done") if error is None else \
            "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        summarise_run(self.cfg.output_dir, self.tracker.path, self.checkpoints.newest(), self.profiler_cfg.save_path,
                      self.cfg.run_config, max(start, 1), last, self.clock, profiler.busy_s, status)


def _due(step: int, freq: int, last: int) -> bool:
    """verl's rule: every `freq` steps and at the last step; -1 never."""
    return freq > 0 and (step % freq == 0 or step == last)


def timing_metrics(times: dict[str, float], result: StepResult, n_devices: int) -> dict[str, float]:
    """verl's timing names: timing_s/<stage>, timing_per_token_ms/<stage>, perf/*."""
    out = {f"timing_s/{k}": v for k, v in times.items()}
    for k, v in times.items():
        tokens = result.response_tokens if k == "gen" else result.num_tokens
        if tokens and k != "step":
            out[f"timing_per_token_ms/{k}"] = 1000.0 * v / tokens
    step_s = times.get("step", 0.0)
    out["perf/total_num_tokens"] = result.num_tokens
    out["perf/time_per_step"] = step_s
    out["perf/throughput"] = result.num_tokens / step_s / n_devices if step_s else 0.0
    out.update(memory_metrics())
    return out


def memory_metrics() -> dict[str, float]:
    """verl's memory names: perf/cpu_memory_used_gb is the host's memory in use (psutil), and
    perf/max_memory_{allocated,reserved}_gb the CUDA allocator's high-water marks; without CUDA
    both are this process's peak RSS. perf/plait_peak_rss_gb is always the driver process's peak RSS."""
    import psutil
    import torch
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30, "perf/plait_peak_rss_gb": peak_rss}
    if torch.cuda.is_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        out["perf/max_memory_allocated_gb"] = out["perf/max_memory_reserved_gb"] = peak_rss
    return out


class StopRequest:
    """A SIGTERM that asks the run to stop once the current step is done and checkpointed (preemption:
    a scheduler's SIGTERM comes with a grace period before its SIGKILL)."""

    def __init__(self):
        self.requested = False


@contextlib.contextmanager
def signals_as_interrupt(stop: Optional[StopRequest] = None):
    """SIGINT raises Interrupted in the main thread, so windows close, no partial checkpoint stays and the
    exit status says which signal it was (130). A first SIGTERM only sets `stop` (the step finishes and
    is saved, exit 0); a second one, or without `stop` any SIGTERM, raises Interrupted (143) at once."""
    def handler(signum, frame):
        if signum == signal.SIGTERM and stop is not None and not stop.requested:
            stop.requested = True  # os.write: a print here could re-enter a write to stderr under way
            os.write(2, b"plait: SIGTERM: finishing this step, then saving and verifying its checkpoint (another "
                        b"SIGTERM or SIGINT stops at once, with the previous checkpoint)\n")
            return
        raise Interrupted(signum)
    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
