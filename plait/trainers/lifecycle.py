"""THE step lifecycle: the one loop every trainer mode runs.

    resume ─▶ start ─▶ [validate] ─▶ for step N in start..last:
                                       profiler.begin_step(N)        window opens if scheduled
                                       trainer.train_step(N, timer)  the mode's stages, timed
                                       validate every test_freq      (inside the step window)
                                       checkpoint every save_freq    (inside the step window)
                                       profiler.end_step(N)          window closes if scheduled
                                       TIMELINE.flush(N)             the step's stage spans: timeline.jsonl
                                       log metrics (console, metrics.jsonl, TensorBoard, W&B)
             finally ─▶ profiler.close(error) ─▶ trainer.close() ─▶ loggers closed

Everything step-keyed — profiler windows, timing metrics, checkpoints, validation, logging — is
here and nowhere else, so every mode gets it identically from step 1. A trainer mode supplies
only the `Trainer` protocol below: what one step does, how to validate, what its state is.
Step N produces policy version N; steps are numbered from 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from plait.profiler import StepProfiler
from plait.profiler.timeline import TIMELINE, TIMELINE_FILE, StagePeaks, fold_peaks, stage_memory_metrics


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
    n_devices: int = 1
    progress: bool = True
    loggers: list[str] = field(default_factory=lambda: ["console"])


class Lifecycle:
    def __init__(self, cfg: LifecycleConfig, trainer: Trainer, profiler_cfg, tracker,
                 shutdown: Callable[[], None] = lambda: None):
        self.cfg, self.trainer, self.profiler_cfg, self.tracker = cfg, trainer, profiler_cfg, tracker
        self.shutdown = shutdown  # the backend's: worker processes and a Ray instance plait started
        self.ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")

    def run(self) -> dict[str, float]:
        """Train to the last step; returns the last step's metrics."""
        last = self.trainer.total_steps()
        profiler = StepProfiler(self.profiler_cfg, last, self.trainer.profile_targets())
        metrics: dict[str, float] = {}
        error: BaseException | None = None
        step = 0
        TIMELINE.open(os.path.join(self.cfg.output_dir, TIMELINE_FILE))
        try:
            with _sigterm_as_interrupt():
                start = self._resume()
                self.tracker.truncate_after(start - 1 if start > 1 else -1)  # a fresh start drops an old step 0 too
                TIMELINE.truncate_after(start - 1)
                self.trainer.start()
                if self.cfg.val_before_train and start == 1 and self.cfg.test_freq != -1:
                    self.tracker.log(self.trainer.validate(), step=0)
                for step in self.tracker.progress(range(start, last + 1), total=last, initial=start - 1):
                    metrics = self._step(step, last, profiler)
                    self.tracker.log(metrics, step=step)
        except BaseException as err:
            error = err
            raise
        finally:
            profiler.close(error)
            self.trainer.close()
            TIMELINE.close(step)  # the rollouter's last spans, after it stopped
            self.tracker.close()
            self.shutdown()
        return metrics

    def _step(self, step: int, last: int, profiler: StepProfiler) -> dict[str, float]:
        timer = StageTimer(self.trainer.version)
        profiler.begin_step(step, version=self.trainer.version)
        with timer.stage("step"):
            result = self.trainer.train_step(step, timer)
            metrics = dict(result.metrics)
            if _due(step, self.cfg.test_freq, last):
                with timer.stage("testing"):
                    metrics.update(self.trainer.validate())
            if _due(step, self.cfg.save_freq, last):
                with timer.stage("save_checkpoint"):
                    self._save(step)
        profiler.end_step(step)
        TIMELINE.flush(step)
        metrics.update(timing_metrics(timer.times, result, self.cfg.n_devices))
        metrics.update(stage_memory_metrics(timer.peaks))
        metrics["training/global_step"] = step
        metrics["training/policy_version"] = self.trainer.version
        return metrics

    # -- checkpoints: global_step_N/ written atomically, tracker file last --------------------------

    def _save(self, step: int) -> None:
        final = os.path.join(self.ckpt_dir, f"global_step_{step}")
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.trainer.save_checkpoint(tmp, step)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(self.ckpt_dir, "latest_checkpointed_iteration.txt"), str(step))
        keep = self.cfg.max_ckpt_to_keep
        if keep:
            for old in sorted(_checkpoint_steps(self.ckpt_dir))[:-keep]:
                shutil.rmtree(os.path.join(self.ckpt_dir, f"global_step_{old}"), ignore_errors=True)

    def _resume(self) -> int:
        """Load the checkpoint the resume mode names; returns the first step to run."""
        mode = self.cfg.resume_mode
        if mode == "disable":
            return 1
        if mode == "resume_path":
            path = self.cfg.resume_from_path
            name = os.path.basename(os.path.normpath(path))
            if not name.startswith("global_step_") or not os.path.isdir(path):
                raise FileNotFoundError(f"trainer.resume_from_path={path!r}: expected an existing global_step_N directory")
            step = int(name.removeprefix("global_step_"))
        else:
            tracker = os.path.join(self.ckpt_dir, "latest_checkpointed_iteration.txt")
            if not os.path.exists(tracker):
                return 1
            step = int(open(tracker).read().strip())
            path = os.path.join(self.ckpt_dir, f"global_step_{step}")
        self.trainer.load_checkpoint(path, step)
        print(f"plait: resumed from {path} (next step {step + 1})", file=sys.stderr)
        return step + 1


def _due(step: int, freq: int, last: int) -> bool:
    """verl's rule: every `freq` steps and at the last step; -1 never."""
    return freq > 0 and (step % freq == 0 or step == last)


def _checkpoint_steps(ckpt_dir: str) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return [int(d.removeprefix("global_step_")) for d in os.listdir(ckpt_dir)
            if d.startswith("global_step_") and d.removeprefix("global_step_").isdigit()]


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread, so windows close and checkpoints stay whole."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
