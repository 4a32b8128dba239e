"""Checkpoints and the output dir: save, resume, set aside, manifest, verify, retire.

    save(N):   global_step_N.tmp-<pid>/  trainer's files, config.json, step_metrics.json, manifest.json
               (last: every file's size and CRC-32) ─▶ renamed global_step_N/ ─▶ `latest` ─▶ retire old
    resume:    disable: step 1 · resume_path: that folder · auto: the newest that verifies and loads,
               each newer one skipped with a warning; config.json compared first (SAFE_TO_CHANGE)
    set aside: before step 1 of this run, crashed saves' temp dirs go, checkpoints at or after the
               first step (another run's) move to previous_runs/<time>/; nothing is deleted

Crash consistency (docs/reliability.md): a kill at any point leaves either the previous checkpoint
latest or the new one whole. One run holds an output dir at a time (`output_dir_lock`). What a
checkpoint holds is the trainer's business (Trainer.save_checkpoint); when to save is the lifecycle's.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import importlib
import json
import os
import resource
import shutil
import sys
import time
import zlib
from typing import Optional

from plait.configtree import ConfigError, raise_all
from plait.data.rewards import missing_module
from plait.errors import RunError
from plait.profiler.naming import set_aside as set_profile_aside
from plait.safeload import UnsafeFileError, first_line
from plait.trainers.tracking import as_record

STEP_METRICS = "step_metrics.json"   # inside global_step_N: that step's metrics record
MANIFEST = "manifest.json"           # inside global_step_N, written last: every file, its size and CRC-32
LATEST = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "config.json"           # inside global_step_N: the run's resolved config tree


class Checkpoints:
    """One run's checkpoints/ folder. `cfg` is the lifecycle's LifecycleConfig (resume mode and path,
    how many to keep, the run's config); `trainer` saves and loads its own state into a folder."""

    def __init__(self, cfg, trainer):
        self.cfg, self.trainer = cfg, trainer
        self.dir = os.path.join(cfg.output_dir, "checkpoints")

    def save(self, step: int, metrics: dict) -> None:
        """global_step_<step>/ with the step's metrics record, written to a temp dir and renamed."""
        final = os.path.join(self.dir, f"global_step_{step}")
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
        _fsync_dir(self.dir)
        _write_atomic(os.path.join(self.dir, LATEST), str(step))
        for old in retired(checkpoint_steps(self.dir), step, self.cfg.max_ckpt_to_keep):
            shutil.rmtree(os.path.join(self.dir, f"global_step_{old}"), ignore_errors=True)
        if self.cfg.checkpoint_callback is not None:  # the checkpoint is whole and latest: the user's hook may read it
            on_save(self.cfg.checkpoint_callback, self.trainer, step, final)

    def resume(self) -> tuple[int, str]:
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

    def is_own(self, path: str) -> bool:
        """Whether a resumed checkpoint is one of this output dir's (its metrics record belongs here)."""
        return bool(path) and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.dir)

    def newest(self) -> str | None:
        steps = checkpoint_steps(self.dir)
        return os.path.join(self.dir, f"global_step_{max(steps)}") if steps else None

    def _newest_loadable(self) -> tuple[int, str]:
        """The newest checkpoint that verifies and loads, warning about each newer one skipped. Once
        one failed mid-load the trainer's state may be partly overwritten, so "none loads" is then
        an error, not a fresh start."""
        failed = None
        for step in sorted(checkpoint_steps(self.dir), reverse=True):
            path = os.path.join(self.dir, f"global_step_{step}")
            problem = verify_checkpoint(path)
            if problem is None:
                problem = self._load(path, step)
                failed = failed or problem
            if problem is None:
                return step, path
            print(f"plait: warning: skipping checkpoint {path}: {problem}", file=sys.stderr)
        if failed:
            raise ConfigError("trainer.resume_mode", self.cfg.resume_mode,
                              f"no checkpoint in {self.dir} loads (the newest that verified: {failed}); move "
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
            saved = flatten(json.load(f))
        now = flatten(json.loads(json.dumps(self.cfg.run_config, default=str)))
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

    def set_aside(self, start: int, metrics_path: str, profile_path: str | None) -> None:
        """Before the first step: remove crashed saves' temp dirs, and move checkpoints at or after
        `start` (another run's, or a newer broken one) with a fresh start's old metrics into
        previous_runs/<time>/, so step numbers of two runs never mix and nothing is deleted.
        A fresh start sets an earlier run's profiler artifacts aside too (previous_runs/ beside profile_path)."""
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if start == 1 and profile_path:
            parent, name = os.path.split(os.path.abspath(profile_path))
            dest = os.path.join(parent, "previous_runs", stamp, name)
            if set_profile_aside(profile_path, dest):
                print(f"plait: moved an earlier run's profiler artifacts from {profile_path} to {dest}", file=sys.stderr)
        if not os.path.isdir(self.dir):
            return
        for name in os.listdir(self.dir):  # a save's folder, or `latest` mid-rewrite
            if ".tmp-" in name:
                stale = os.path.join(self.dir, name)
                shutil.rmtree(stale) if os.path.isdir(stale) else os.remove(stale)
        later = [s for s in checkpoint_steps(self.dir) if s >= start]
        if not later:
            return
        dest = os.path.join(self.cfg.output_dir, "previous_runs", stamp)
        os.makedirs(os.path.join(dest, "checkpoints"), exist_ok=True)
        for s in later:
            os.replace(os.path.join(self.dir, f"global_step_{s}"), os.path.join(dest, "checkpoints", f"global_step_{s}"))
        if start == 1 and os.path.exists(metrics_path):
            shutil.copy2(metrics_path, os.path.join(dest, "metrics.jsonl"))
        print(f"plait: moved checkpoints of steps {sorted(later)} (not part of this run) to {dest}", file=sys.stderr)
        if start == 1:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.dir, LATEST))


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
    "trainer.check_weight_sync", "trainer.max_restarts", "trainer.val_only", "trainer.checkpoint_callback_class",
)


def checkpoint_callback_class(fqn: str) -> type:
    """verl 0.9.1's `trainer.checkpoint_callback_class`: the class `module.Class`, imported as Python imports
    it (the working directory first, as under verl's `python -m`); a ConfigError line when it does not import."""
    key = "trainer.checkpoint_callback_class"
    module_name, _, name = fqn.rpartition(".")
    if not module_name:
        raise ConfigError(key, fqn, "a fully qualified class name, module.Class (verl's form)")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except ModuleNotFoundError as err:
        raise ConfigError(key, fqn, f"importing it failed: {missing_module(err)}") from None
    except AttributeError:
        raise ConfigError(key, fqn, f"module {module_name} has no {name}") from None
    except Exception as err:  # noqa: BLE001 - the user's module-level code: one line
        raise ConfigError(key, fqn, f"importing it failed: {type(err).__name__}: {first_line(err)}") from None
    if not callable(getattr(cls, "on_save", None)):
        raise ConfigError(key, fqn, "has no on_save(trainer, global_step, checkpoint_dir, async_save) method")
    return cls


def make_checkpoint_callback(fqn: str, config):
    """The callback object, built as verl builds it (`cls(config=...)`); its constructor's failure is one line."""
    cls = checkpoint_callback_class(fqn)
    try:
        return cls(config=config)
    except Exception as err:  # noqa: BLE001 - the user's constructor: one line
        raise ConfigError("trainer.checkpoint_callback_class", fqn,
                          f"{cls.__name__}(config=...) raised {type(err).__name__}: {first_line(err)}") from None


def on_save(callback, trainer, step: int, path: str) -> None:
    """The user's hook after checkpoint `path` of `step` is whole and latest. As in verl its failure stops the
    run (a hook that uploads or registers checkpoints must not fail unseen), with one line naming it."""
    try:
        callback.on_save(trainer=trainer, global_step=step, checkpoint_dir=path, async_save=False)
    except Exception as err:  # noqa: BLE001 - user code: one line, not a traceback
        raise RunError(f"trainer.checkpoint_callback_class {type(callback).__name__}.on_save raised "
                       f"{type(err).__name__}: {first_line(err)} after the checkpoint of step {step} (written and "
                       f"verified: {path})") from err


def safe_to_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(key, p + ".*") for p in SAFE_TO_CHANGE)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; an empty dict stays a value."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        out.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
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


def checkpoint_steps(ckpt_dir: str) -> list[int]:
    """The steps of the global_step_N folders in `ckpt_dir` (none when it does not exist)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return [int(d.removeprefix("global_step_")) for d in os.listdir(ckpt_dir)
            if d.startswith("global_step_") and d.removeprefix("global_step_").isdigit()]


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """One run per output dir: an exclusive flock on <output_dir>/.plait.lock, which the OS
    releases on any exit, kill -9 included. A second run is refused naming the holder's pid. Yields the
    lock's path; its mtime is the run's start (profiler/analysis/report.py's run_ended reads it)."""
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
        yield path
    finally:
        os.close(fd)  # releases the lock


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
