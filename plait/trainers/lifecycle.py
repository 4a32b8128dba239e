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
Step N produces policy version N; steps are numbered from 1.

Crash consistency (docs/reliability.md): a checkpoint is written to a temp dir with the step's
metrics record, the run's config and a manifest (sizes, CRC-32) last, then renamed; resume takes
the newest one that verifies and loads, once its config agrees with this run's, and metrics.jsonl
is cut back to (or restored up to) that step, so a kill at any point neither loses nor repeats a
step. One run holds an output dir at a time (`output_dir_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import resource
import shutil
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from plait.configtree import ConfigError, raise_all
from plait.errors import Interrupted, RunError
from plait.profiler import StepProfiler
from plait.profiler.naming import MANIFEST as PROFILE_MANIFEST, set_aside, write_location
from plait.profiler.analysis.verdict import of_run, settings_of, verdicts
from plait.profiler.timeline import TIMELINE, TIMELINE_FILE, StagePeaks, fold_peaks, read_timeline, stage_memory_metrics
from plait.safeload import UnsafeFileError, first_line
from plait.trainers.summary import RunClock, memory_capacity_gb, summarise, write_summary
from plait.trainers.tracking import as_record, read_records


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
    run_config: Optional[dict] = None        # the resolved config tree: saved in each checkpoint, compared on resume
    allow_config_change: bool = False        # trainer.resume_allow_config_change


class Lifecycle:
    def __init__(self, cfg: LifecycleConfig, trainer: Trainer, profiler_cfg, tracker,
                 shutdown: Callable[[], None] = lambda: None, started: Optional[float] = None):
        self.cfg, self.trainer, self.profiler_cfg, self.tracker = cfg, trainer, profiler_cfg, tracker
        self.shutdown = shutdown  # the backend's: worker processes and a Ray instance plait started
        self.ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
        self.clock = RunClock(started)  # from build's start, so start-up counts model and worker set-up

    def run(self) -> dict[str, float]:
        """Train to the last step; returns the last step's metrics."""
        last = self.trainer.total_steps()
        profiler = StepProfiler(self.profiler_cfg, last, self.trainer.profile_targets())
        metrics: dict[str, float] = {}
        error: BaseException | None = None
        step = start = 0
        TIMELINE.open(os.path.join(self.cfg.output_dir, TIMELINE_FILE))
        try:
            with signals_as_interrupt():
                start = self._restart(last, profiler)
                self.trainer.start()
                self.clock.parts["startup"] = self.clock.elapsed()
                if self.cfg.val_before_train and start == 1 and self.cfg.test_freq != -1:
                    with self.clock.part("validation"):
                        self.tracker.log(self.trainer.validate(), step=0)
                for step in self.tracker.progress(range(start, last + 1), total=last, initial=start - 1):
                    metrics = self._step(step, last, profiler)
        except BaseException as err:
            error = err
            raise
        finally:
            profiler.close(error)
            self.trainer.close()
            TIMELINE.close(step)  # the rollouter's last spans, after it stopped
            self.tracker.close()
            self.shutdown()
            self._summarise(start, last, profiler, error)
        return metrics

    def _restart(self, last: int, profiler: StepProfiler) -> int:
        """Resume (or start fresh) and bring the run's logs to the step before the first one to run;
        say in one line when that leaves nothing to do, or listed profile steps behind."""
        start, path = self._resume()
        if start > last:
            print(f"plait: nothing to do: resumed after step {start - 1} and the run's last step is {last} "
                  "(trainer.total_training_steps); raise it, or start afresh with trainer.resume_mode=disable "
                  "or a new trainer.experiment_name", file=sys.stderr)
        profiler.note_start(start)
        self._set_aside(start)
        if self.profiler_cfg.save_path:
            write_location(self.cfg.output_dir, self.profiler_cfg.save_path, self.profiler_cfg.tool)
        # metrics.jsonl ends at the checkpoint's step (its record restored if this run's line was
        # lost; not for a checkpoint of another output dir); a fresh start drops an old step 0 too
        own = path and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.ckpt_dir)
        self.tracker.keep_until(start - 1 if start > 1 else -1, os.path.join(path, STEP_METRICS) if own else "")
        TIMELINE.truncate_after(start - 1)
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
            if _due(step, self.cfg.save_freq, last):
                with timer.stage("save_checkpoint"):
                    self._save(step, self._record(step, metrics, timer, result))
        profiler.end_step(step)
        with TIMELINE.span("trainer", "log", self.trainer.version):  # between steps: a span, so no time is unnamed
            record = self._record(step, metrics, timer, result)
            self.tracker.log(record, step=step)
        TIMELINE.flush(step)
        return record

    def _record(self, step: int, metrics: dict, timer: StageTimer, result: StepResult) -> dict[str, float]:
        out = {**metrics, **timing_metrics(timer.times, result, self.cfg.n_devices), **stage_memory_metrics(timer.peaks)}
        out["training/global_step"] = step
        out["training/policy_version"] = self.trainer.version
        return out

    # -- checkpoints: global_step_N/ written to a temp dir, manifest last, renamed; `latest` a hint --

    def _save(self, step: int, metrics: dict) -> None:
        final = os.path.join(self.ckpt_dir, f"global_step_{step}")
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            self.trainer.save_checkpoint(tmp, step)
            if self.cfg.run_config is not None:
                _write_atomic(os.path.join(tmp, RUN_CONFIG), json.dumps(self.cfg.run_config, default=str))
            _write_atomic(os.path.join(tmp, STEP_METRICS), json.dumps(as_record(metrics, step)))  # durable with it
            write_manifest(tmp, step)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing partial, whatever stopped the save
            if isinstance(err, (OSError, RuntimeError)) and not isinstance(err, RunError):  # a worker's failure says itself
                raise RunError(f"checkpoint of step {step} not written to {tmp}: {_cause(err, tmp)}; "
                               f"the previous checkpoint stays latest") from err
            raise
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.ckpt_dir)
        _write_atomic(os.path.join(self.ckpt_dir, LATEST), str(step))
        for old in retired(_checkpoint_steps(self.ckpt_dir), step, self.cfg.max_ckpt_to_keep):
            shutil.rmtree(os.path.join(self.ckpt_dir, f"global_step_{old}"), ignore_errors=True)

    def _resume(self) -> tuple[int, str]:
        """Load the checkpoint the resume mode names; returns the first step to run and its path."""
        mode = self.cfg.resume_mode
        if mode == "disable":
            return 1, ""
        if mode == "resume_path":
            path = self.cfg.resume_from_path
            name = os.path.basename(os.path.normpath(path))
            if not name.startswith("global_step_") or not os.path.isdir(path):
                raise ConfigError("trainer.resume_from_path", path, "expected an existing global_step_N directory")
            step = int(name.removeprefix("global_step_"))
            problem = verify_checkpoint(path) or self._load(path, step)
            if problem:
                raise ConfigError("trainer.resume_from_path", path, problem)
        else:
            step, path = self._newest_loadable()
            if step == 0:
                return 1, ""
        print(f"plait: resumed from {path} (next step {step + 1})", file=sys.stderr)
        return step + 1, path

    def _newest_loadable(self) -> tuple[int, str]:
        """The newest checkpoint that verifies and loads, warning about each newer one skipped. Once
        one failed mid-load the trainer's state may be partly overwritten, so "none loads" is then
        an error, not a fresh start."""
        failed = None
        for step in sorted(_checkpoint_steps(self.ckpt_dir), reverse=True):
            path = os.path.join(self.ckpt_dir, f"global_step_{step}")
            problem = verify_checkpoint(path)
            if problem is None:
                problem = self._load(path, step)
                failed = failed or problem
            if problem is None:
                return step, path
            print(f"plait: warning: skipping checkpoint {path}: {problem}", file=sys.stderr)
        if failed:
            raise ConfigError("trainer.resume_mode", self.cfg.resume_mode,
                              f"no checkpoint in {self.ckpt_dir} loads (the newest that verified: {failed}); move "
                              "the folder aside or set trainer.resume_mode=disable to start fresh")
        return 0, ""

    def _load(self, path: str, step: int) -> str | None:
        """Load a verified checkpoint after comparing its config; None when it loaded, else why not
        (a truncated, corrupt or unpicklable file, wrong keys or shapes)."""
        try:
            self._check_config(path)
            self.trainer.load_checkpoint(path, step)
        except (RunError, ConfigError):  # a Ray worker failed (the backend is down), or a refused config
            raise
        except UnsafeFileError as err:
            return str(err).replace(os.path.join(path, ""), "")
        except Exception as err:  # noqa: BLE001 - any failure to load is a reason to skip it
            return f"it does not load ({type(err).__name__}: {first_line(err)})"
        return None

    def _check_config(self, path: str) -> None:
        """Refuse to resume a checkpoint whose run meant something else: one line per changed key
        that is not safe to change (SAFE_TO_CHANGE), unless trainer.resume_allow_config_change."""
        if self.cfg.run_config is None or not os.path.isfile(os.path.join(path, RUN_CONFIG)):
            return  # a checkpoint from before configs were saved: nothing to compare
        with open(os.path.join(path, RUN_CONFIG)) as f:
            saved = _flatten(json.load(f))
        now = _flatten(json.loads(json.dumps(self.cfg.run_config, default=str)))
        changed = [(key, saved[key], now[key]) for key in now
                   if key in saved and saved[key] != now[key] and not safe_to_change(key)]
        if self.cfg.allow_config_change:
            for key, old, new in changed:
                print(f"plait: warning: resuming {path} with {key} changed from {old!r} to {new!r} "
                      "(trainer.resume_allow_config_change=true)", file=sys.stderr)
            return
        raise_all([ConfigError(key, new, f"the checkpoint {path} was trained with {old!r}; resuming with another "
                               "value changes what the run means: set trainer.resume_allow_config_change=true to "
                               "resume anyway, or start a new experiment (trainer.experiment_name)")
                   for key, old, new in changed])

    def _summarise(self, start: int, last: int, profiler: StepProfiler, error: BaseException | None) -> None:
        """summary.json in the output dir, and the console lines unless the run failed (its error is the last word)."""
        status = "done" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        save_path = self.profiler_cfg.save_path
        steps = _checkpoint_steps(self.ckpt_dir)
        tb = os.path.join(self.cfg.output_dir, "tensorboard")
        paths = {"output_dir": self.cfg.output_dir, "metrics": self.tracker.path,
                 "timeline": os.path.join(self.cfg.output_dir, TIMELINE_FILE),
                 "checkpoint": os.path.join(self.ckpt_dir, f"global_step_{max(steps)}") if steps else None,
                 "tensorboard": tb if os.path.isdir(tb) else None,
                 "profile": save_path if save_path and os.path.exists(os.path.join(save_path, PROFILE_MANIFEST)) else None}
        try:
            records = read_records(self.tracker.path) if os.path.exists(self.tracker.path) else []
            summary = summarise(records, max(start, 1), last, self.clock, profiler.busy_s, paths, status)
            summary["settings"] = settings_of(_flatten(self.cfg.run_config or {}), memory_capacity_gb())
            summary["verdict"] = self._verdict(records, max(start, 1), summary)
            write_summary(self.cfg.output_dir, summary, console=status != "failed")
        except (OSError, ValueError) as err:  # the summary never hides the run's own outcome
            print(f"plait: warning: no run summary written: {type(err).__name__}: {err}", file=sys.stderr)

    def _verdict(self, records: list[dict], first: int, summary: dict) -> list[dict]:
        """The profile report's verdict on this run's steps (profiler/analysis/verdict.py); a rule that
        fails says so in one line and leaves the summary whole."""
        path = os.path.join(self.cfg.output_dir, TIMELINE_FILE)
        try:
            spans = [s for s in read_timeline(path) if s["step"] >= first] if os.path.exists(path) else []
            return [v.as_dict() for v in verdicts(of_run(spans, [r for r in records if r.get("step", 0) >= first], summary))]
        except Exception as err:  # noqa: BLE001 - advice must never cost the run its summary
            print(f"plait: warning: no verdict: {type(err).__name__}: {err}", file=sys.stderr)
            return []

    def _set_aside(self, start: int) -> None:
        """Before the first step: remove crashed saves' temp dirs, and move checkpoints at or after
        `start` (another run's, or a newer broken one) with a fresh start's old metrics into
        previous_runs/<time>/, so step numbers of two runs never mix and nothing is deleted.
        A fresh start sets an earlier run's profiler artifacts aside too (previous_runs/ beside save_path)."""
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        save_path = self.profiler_cfg.save_path
        if start == 1 and save_path:
            parent, name = os.path.split(os.path.abspath(save_path))
            dest = os.path.join(parent, "previous_runs", stamp, name)
            if set_aside(save_path, dest):
                print(f"plait: moved an earlier run's profiler artifacts from {save_path} to {dest}", file=sys.stderr)
        if not os.path.isdir(self.ckpt_dir):
            return
        for name in os.listdir(self.ckpt_dir):  # a save's folder, or `latest` mid-rewrite
            if ".tmp-" in name:
                stale = os.path.join(self.ckpt_dir, name)
                shutil.rmtree(stale) if os.path.isdir(stale) else os.remove(stale)
        later = [s for s in _checkpoint_steps(self.ckpt_dir) if s >= start]
        if not later:
            return
        dest = os.path.join(self.cfg.output_dir, "previous_runs", stamp)
        os.makedirs(os.path.join(dest, "checkpoints"), exist_ok=True)
        for s in later:
            os.replace(os.path.join(self.ckpt_dir, f"global_step_{s}"), os.path.join(dest, "checkpoints", f"global_step_{s}"))
        if start == 1 and os.path.exists(self.tracker.path):
            shutil.copy2(self.tracker.path, os.path.join(dest, "metrics.jsonl"))
        print(f"plait: moved checkpoints of steps {sorted(later)} (not part of this run) to {dest}", file=sys.stderr)
        if start == 1:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.ckpt_dir, LATEST))


STEP_METRICS = "step_metrics.json"   # inside global_step_N: that step's metrics record
MANIFEST = "manifest.json"           # inside global_step_N, written last: every file, its size and CRC-32
LATEST = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "config.json"           # inside global_step_N: the run's resolved config tree

# Keys a resume may change silently (docs/reliability.md): where output goes, how often things
# happen, how long the run is, how it is profiled and placed. Every other key changes what the run
# means (data, batch sizes, model, algorithm, loss, seeds) and is refused when it differs.
SAFE_TO_CHANGE = (
    "trainer.logger", "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir",
    "trainer.save_freq", "trainer.test_freq", "trainer.total_training_steps", "trainer.total_epochs",
    "trainer.max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "trainer.log_val_generations", "trainer.val_before_train", "trainer.resume_mode", "trainer.resume_from_path",
    "trainer.resume_allow_config_change", "trainer.backend", "trainer.ray", "trainer.device", "trainer.num_threads",
    "trainer.nnodes", "trainer.n_gpus_per_node", "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node", "reward.reward_model.enable_resource_pool", "reward.reward_model.nnodes",
    "reward.reward_model.n_gpus_per_node", "global_profiler", "*.profiler", "*.optim.total_training_steps",
    "reward.custom_reward_function.timeout", "reward.num_workers", "reward.memory_limit_mb", "reward.max_processes",
)


def safe_to_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + ".*") for p in SAFE_TO_CHANGE)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        out.update(_flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def write_manifest(path: str, step: int) -> None:
    """List every file under `path` with its size and CRC-32, each fsync'd first, then the manifest."""
    files = {}
    for root, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = {"size": os.path.getsize(full), "crc32": _crc32(full, sync=True)}
    _write_atomic(os.path.join(path, MANIFEST), json.dumps({"step": step, "files": files}))


def verify_checkpoint(path: str) -> str | None:
    """None when every file the manifest lists is there with its size and CRC-32; else what is wrong."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"no readable {MANIFEST} ({type(err).__name__}); the save did not finish"
    if not isinstance(files, dict) or not all(isinstance(w, dict) and isinstance(w.get("size"), int)
                                              and isinstance(w.get("crc32"), int) for w in files.values()):
        return f"{MANIFEST} is not one plait wrote (each file needs its size and crc32)"
    for rel, want in files.items():
        if os.path.isabs(rel) or ".." in rel.split(os.sep):  # crafted: plait reads the checkpoint's own files only
            return f"the manifest names a file outside the checkpoint ({rel!r})"
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != want["size"]:
            return f"{rel} is {os.path.getsize(full)} bytes, the manifest says {want['size']}"
        if _crc32(full) != want["crc32"]:
            return f"{rel} does not match its checksum"
    return None


def retired(steps: list[int], just_saved: int, keep: Optional[int]) -> list[int]:
    """Checkpoints to delete after saving `just_saved`: all but the newest `keep` at or before it
    (it among them, whatever the numbers of the others). None or 0 keeps all."""
    if not keep:
        return []
    older = sorted(s for s in steps if s < just_saved)
    return older[:max(len(older) - (keep - 1), 0)]


def _crc32(path: str, sync: bool = False) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
        if sync:
            os.fsync(f.fileno())
    return crc


def _cause(err: BaseException, path: str) -> str:
    """The one-line cause of a failed write. torch.save reports one without its errno
    ("enforce fail at inline_container.cc"), so the usual suspects are checked by name."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"File too large? (the file-size limit, ulimit -f, is {limit} bytes)"
    free = shutil.disk_usage(os.path.dirname(path)).free
    if free < 2**28:
        return f"No space left on device? ({free // 2**20} MiB free)"
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


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
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
def signals_as_interrupt():
    """SIGTERM and SIGINT raise Interrupted in the main thread, so windows close, no partial
    checkpoint stays and the exit status says which signal it was (143, 130)."""
    def handler(signum, frame):
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


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """One run per output dir: an exclusive flock on <output_dir>/.plait.lock, which the OS
    releases on any exit, kill -9 included. A second run is refused naming the holder's pid."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ".plait.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError("trainer.default_local_dir", output_dir,
                              f"in use by another plait run (pid {holder}); wait for it to end or "
                              "choose another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
