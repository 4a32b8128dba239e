"""build(config) -> a ready lifecycle; run() trains. The single controller's wiring, nothing more.

`preflight` refuses, before any training work, what cannot run here (a profiler tool, missing
data files, model directory or reward function); `plait config show` runs the same checks. `build`
then starts the backend, builds the mode's trainer (plait/build.py's MODES: one row per mode,
diffusion included) with the tracker it logs to, and hands it to the lifecycle.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
import time

import torch
import transformers

from plait.config import PlaitConfig
from plait.configtree import ConfigError, raise_all, to_dict
from plait.modes import MODES
from plait.errors import RunError
from plait.data.reward_pool import close_reward_workers
from plait.checks import check_data_files, check_loggers, collect_errors, not_a_directory
from plait.data.dataset import read_column
from plait.data.rewards import needs_string_truth, resolve_reward, unscored_sources
from plait.builtin_models import builtin_model
from plait.workers.engine import ENGINES
from plait.models import GENRM, RM_KEY, check_model_dir, reward_model_kind
from plait.profiler import RoleProfilerConfig, validate_environment
from plait.profiler.config import ROLE_KEYS
from plait.trainers.checkpoint import checkpoint_callback_class, checkpoint_steps, make_checkpoint_callback, output_dir_lock
from plait.trainers.lifecycle import Lifecycle, LifecycleConfig
from plait.trainers.sampler import sampler_class
from plait.trainers.tracking import Tracker
from plait.allocator import keep_freed_memory

log = logging.getLogger("plait")


def resolve_device(cfg: PlaitConfig) -> str:
    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", device, "CUDA is not available on this machine; use cpu or auto")
    return device


def check_data_sources(cfg: PlaitConfig) -> None:
    """With neither a reward file nor a reward model, every row's data source (data.reward_fn_key)
    needs a built-in reward, and the scorers that read the ground truth as text (DAPO, aime*, math)
    a string one: every train and val file is checked here, before any model loads, rather than at
    the first reward. A file that does not read is left to load_dataset to name."""
    if (not MODES[cfg.trainer.mode].lm or cfg.reward.custom_reward_function.path or cfg.reward.reward_model.enable
            or cfg.data.custom_cls.path):  # a dataset class's rows: checked as it loads them (custom_dataset.py)
        return
    errors = []
    for files_key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in files or []:
            try:
                errors += source_errors(files_key, path, cfg.data.reward_fn_key, cfg.reward.sandbox_fusion.url)
            except (OSError, ValueError):
                continue
    raise_all(errors)


def check_custom_dataset(cfg: PlaitConfig) -> None:
    """data.custom_cls: its class loads and is a torch Dataset, and it has files to read (built at start)."""
    c = cfg.data.custom_cls
    if not c.path:
        return
    if not MODES[cfg.trainer.mode].lm:
        raise ConfigError("data.custom_cls.path", c.path, "the diffusion trainer reads prompt files; a dataset class "
                                                         "is implemented for the language-model modes")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files", cfg.data.train_files, "data.custom_cls reads the files given here "
                                                                  "(verl hands them to the class); set them")
    from plait.data.custom_dataset import load_dataset_class
    load_dataset_class(c.path, c.name)


def check_tool_classes(cfg: PlaitConfig) -> None:
    """The configured tools plait refuses by class name, before any model loads. verl 0.9.1's agent-loop
    workers build every tool of the file at start, whichever loop the rows run, so verl stops there too."""
    from plait.agents.compat import refused_tool_lines
    path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    raise_all([ConfigError("actor_rollout_ref.rollout.multi_turn.tool_config_path", path, line)
               for line in (refused_tool_lines(path) if path else [])])


def source_errors(files_key: str, path: str, key: str, sandbox_url: str | None = None) -> list[ConfigError]:
    """The file's data sources without a built-in reward, and its first row whose scorer needs a string
    ground truth and has another type (rewards.unscored_sources)."""
    sources = read_column(path, key)
    truths = (read_column(path, "reward_model") if any(map(needs_string_truth, sources)) else [None] * len(sources))
    return unscored_sources(files_key, path, key, sources, truths, sandbox_url)


def check_model_path(cfg: PlaitConfig) -> None:
    """A model dir without config, weights or tokenizer, or not a causal LM, is refused before any work;
    so is a built-in model name (builtin_models.BUILTIN_MODELS) whose package is missing."""
    model, rm = cfg.actor_rollout_ref.model, cfg.reward.reward_model
    builtin = builtin_model(model.path)
    checks = []
    if builtin is not None:  # built on first use (plait/build.py); here only what it needs is checked
        checks.append(lambda: builtin.check("actor_rollout_ref.model.path", model.path))
    elif model.path is not None and MODES[cfg.trainer.mode].lm:
        checks.append(lambda: check_model_dir("actor_rollout_ref.model.path", model.path))
    if cfg.critic.enable and cfg.critic.model.path:
        checks.append(lambda: check_model_dir("critic.model.path", cfg.critic.model.path, tokenizer=False))
    judge = builtin_model(rm.model_path) if rm.enable else None

    def builtin_judge():  # a built-in model as the reward model is a causal LM: a reward function must ask it
        if not cfg.reward.custom_reward_function.path:
            raise ConfigError(RM_KEY, rm.model_path, f"a built-in causal LM without a reward function to ask it: {GENRM}")
        judge.check(RM_KEY, rm.model_path)
        judge_engine(cfg)
    if judge is not None:
        checks.append(builtin_judge)
    elif rm.enable and rm.model_path is not None and os.path.isdir(rm.model_path):
        checks.append(lambda: reward_model_kind(rm.model_path, bool(cfg.reward.custom_reward_function.path)) == "judge"
                      and judge_engine(cfg))
    teachers = []  # local folders; a built-in model's name is built on first use, as the policy's
    for key, path in teacher_paths(cfg):
        if builtin_model(path) is not None:
            checks.append(lambda key=key, path=path: builtin_model(path).check(key, path))
            continue
        teachers.append((key, path))
        if os.path.isdir(path):
            checks.append(lambda key=key, path=path: check_model_dir(key, path, tokenizer=False))
    errors = []
    for check in checks:
        try:
            check()
        except ConfigError as err:
            errors.append(err)
    for key, path in (("actor_rollout_ref.model.lora_adapter_path", model.lora_adapter_path if model.lora_rank else None),
                      ("reward.reward_model.model_path", rm.model_path if rm.enable and judge is None else None), *teachers):
        if path is not None and not os.path.isdir(path):
            errors.append(ConfigError(key, path, not_a_directory(path)))
    raise_all(errors)


def judge_engine(cfg: PlaitConfig) -> None:
    """A judge's engine must run here (a classifier reward model does not use one: verl serves it from vLLM)."""
    name = cfg.reward.reward_model.rollout.name
    why = ENGINES[name].unavailable()
    if why is not None:
        raise ConfigError("reward.reward_model.rollout.name", name, why)


def teacher_paths(cfg: PlaitConfig) -> list[tuple[str, str]]:
    """(config key, folder) of each distillation teacher this run loads."""
    d = cfg.distillation
    if not d.enabled:
        return []
    names = {id(t): name for name, t in d.teacher_models.items()}
    return [(f"distillation.teacher_models.{names[id(t)]}.model_path", t.model_path) for t in d.teachers().values()]


def preflight(cfg: PlaitConfig) -> None:
    """Everything refused before any training work, all errors together."""
    raise_all(preflight_errors(cfg))


def preflight_errors(cfg: PlaitConfig) -> list[ConfigError]:
    for role in absent_profiled_roles(cfg):
        log.warning("profiler: %s.profiler.enable is true but this run has no %s role (%s); it is not profiled",
                    ROLE_KEYS[role], role, ABSENT_WHY[role])
    roles_cfg = role_profilers(cfg)
    return collect_errors((lambda: validate_environment(cfg.global_profiler, roles_cfg),
                           lambda: check_memory_profiling(cfg, roles_cfg), lambda: check_data_files(cfg),
                           lambda: check_data_sources(cfg), lambda: check_custom_dataset(cfg), lambda: check_tool_classes(cfg),
                           lambda: check_model_path(cfg),
                           lambda: resolve_reward(cfg.reward, cfg.data.max_response_length),
                           lambda: resolve_device(cfg), lambda: check_loggers(cfg.trainer.logger),
                           lambda: check_user_classes(cfg)))


def check_user_classes(cfg: PlaitConfig) -> None:
    """verl 0.9.1's extension classes this run names import (ConfigError lines otherwise), and val_only has a
    validation set to run."""
    t = cfg.trainer
    if t.checkpoint_callback_class:
        checkpoint_callback_class(t.checkpoint_callback_class)
    if MODES[t.mode].v1:
        sampler_class(t.v1.sampler.custom_sampler.path, t.v1.sampler.custom_sampler.name)
    if t.val_only and t.val_before_train and cfg.data.train_files is not None and not cfg.data.val_files:
        raise ConfigError("trainer.val_only", True, "needs data.val_files: it validates and stops")


def build(cfg: PlaitConfig, progress: bool = True, checked: bool = False) -> Lifecycle:
    started = time.perf_counter()  # the run summary's start-up time counts model and worker set-up
    if not checked:  # the CLI has run preflight already: its warnings are said once
        preflight(cfg)
    transformers.utils.logging.disable_progress_bar()  # per-load weight bars drown the step lines
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = resolve_device(cfg)
    if device == "cpu":  # the local backend's workers compute in this process
        keep_freed_memory()
    t = cfg.trainer
    tracker = Tracker(cfg.output_dir, t.logger, t.project_name, t.experiment_name or t.mode, to_dict(cfg), progress=progress)
    announce_resume(cfg)  # before Ray's start-up: a reused output dir is said while it is cheap to stop
    backend = make_backend(cfg)
    try:
        from plait.build import TRAINERS  # here, not at the top: `plait config show` needs no trainer or worker
        trainer = TRAINERS[t.mode](cfg, backend, device, tracker)
    except BaseException:
        backend.shutdown()
        close_reward_workers()
        raise
    lc = LifecycleConfig(output_dir=cfg.output_dir, test_freq=t.test_freq, save_freq=t.save_freq,
                         val_before_train=t.val_before_train, resume_mode=t.resume_mode,
                         resume_from_path=t.resume_from_path, max_ckpt_to_keep=checkpoints_to_keep(cfg),
                         n_devices=backend.world_size,
                         run_config=to_dict(cfg), allow_config_change=t.resume_allow_config_change,
                         val_only=t.val_only and t.val_before_train,  # verl validates only then (and trains otherwise)
                         checkpoint_callback=make_checkpoint_callback(t.checkpoint_callback_class, omega_tree(cfg))
                         if t.checkpoint_callback_class else None)

    def shutdown():
        backend.shutdown()
        close_reward_workers()
    profiling = cfg.global_profiler
    if profiling.tool and not any(rc.enable for rc in role_profilers(cfg).values()):
        profiling = dataclasses.replace(profiling, steps=None)  # preflight said nothing is profiled: no windows either
    return Lifecycle(lc, trainer, profiling, tracker, shutdown=shutdown, started=started)


def omega_tree(cfg: PlaitConfig):
    """The config as verl hands it to user classes: an OmegaConf DictConfig where omegaconf is installed, else
    dicts that answer attribute access too (`config.trainer.save_freq`, `config.trainer.get(...)`)."""
    tree = to_dict(cfg)
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return AttrDict.of(tree)
    return OmegaConf.create(tree)


class AttrDict(dict):
    """A dict whose keys are attributes too, as a DictConfig's are."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @staticmethod
    def of(tree):
        return AttrDict({k: AttrDict.of(v) for k, v in tree.items()}) if isinstance(tree, dict) else tree


def announce_resume(cfg: PlaitConfig) -> None:
    """One line when the output dir already holds checkpoints that resume_mode=auto will continue from:
    two commands with the same experiment name (the default: the mode's) share one output dir."""
    steps = checkpoint_steps(os.path.join(cfg.output_dir, "checkpoints"))
    if cfg.trainer.resume_mode == "auto" and steps:
        print(f"plait: {cfg.output_dir} holds checkpoints of an earlier run (newest: step {max(steps)}); this run "
              "continues it (trainer.resume_mode=auto); a new trainer.experiment_name starts afresh", file=sys.stderr)


def checkpoints_to_keep(cfg: PlaitConfig) -> int | None:
    """A checkpoint holds the actor and the critic together (a resume needs both), so the tightest of
    max_ckpt_to_keep, max_actor_ckpt_to_keep and (with a critic) max_critic_ckpt_to_keep applies."""
    t = cfg.trainer
    limits = [t.max_ckpt_to_keep, t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep if cfg.critic.enable else None]
    return min((n for n in limits if n is not None), default=None)


def role_profilers(cfg: PlaitConfig) -> dict:
    """Each role's profiler node; a role this run does not have is profiled nothing (preflight
    warns): its name would otherwise label an artifact that holds other roles' stages."""
    absent = absent_profiled_roles(cfg)
    return {role: RoleProfilerConfig() if role in absent else node for role, node in _profiler_nodes(cfg).items()}


def absent_profiled_roles(cfg: PlaitConfig) -> list[str]:
    present = run_roles(cfg)
    return [role for role, node in _profiler_nodes(cfg).items() if node.enable and role not in present]


def _profiler_nodes(cfg: PlaitConfig) -> dict:
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor.profiler, "rollout": arr.rollout.profiler, "ref": arr.ref.profiler,
            "critic": cfg.critic.profiler, "reward_model": cfg.reward.reward_model.profiler,
            "teacher": cfg.distillation.profiler}


ABSENT_WHY = {"rollout": "trainer.mode=diffusion samples inside the actor",
              "ref": "no KL term uses a reference policy, or with LoRA the actor computes it",
              "critic": "critic.enable is false (no GAE)", "reward_model": "reward.reward_model.enable is false",
              "teacher": "distillation.enabled is false",
              "actor": ""}


def run_roles(cfg: PlaitConfig) -> set[str]:
    """The roles build() spawns for this config."""
    if not MODES[cfg.trainer.mode].lm:
        return {"actor"} | ({"ref"} if cfg.diffusion.actor.kl_loss_coef > 0 else set())
    lora = cfg.actor_rollout_ref.model.lora_rank > 0  # the actor's base model is the reference
    return ({"actor", "rollout"} | ({"ref"} if cfg.uses_ref and not lora else set())
            | ({"critic"} if cfg.critic.enable else set()) | ({"reward_model"} if cfg.reward.reward_model.enable else set())
            | ({"teacher"} if cfg.distillation.enabled else set()))


def check_memory_profiling(cfg: PlaitConfig, roles_cfg: dict) -> None:
    """torch_memory on CPU records allocations only on the collector's thread (the driver's main
    thread): a rollout thread beside the trainer on the local backend (plait/modes.py) would be missing from it."""
    t, g = cfg.trainer, cfg.global_profiler
    if (g.tool == "torch_memory" and g.steps and MODES[t.mode].rollout_thread and t.backend == "local"
            and roles_cfg["rollout"].enable and not torch.cuda.is_available()):
        raise ConfigError("global_profiler.tool", g.tool,
                          f"without CUDA it records only the driver's main thread, and trainer.mode={t.mode} on the "
                          "local backend generates on another thread: use trainer.backend=ray (the rollout gets its "
                          "own process and artifact), or profile the rollout with tool=torch")


def make_backend(cfg: PlaitConfig):
    from plait.backends import make_backend as backend_for
    return backend_for(cfg, role_profilers(cfg), resolve_device(cfg))


@contextlib.contextmanager
def crash_log(output_dir: str):
    """A run that dies on a fatal signal (SIGSEGV, an abort in malloc) runs no `finally`, so it writes no summary:
    faulthandler writes every thread's Python stack to <output_dir>/crash.log instead (`plait profile report`
    names it). Removed when the run ends in Python, as nearly every run does."""
    import faulthandler
    path = os.path.join(output_dir, "crash.log")
    was = faulthandler.is_enabled()
    f = open(path, "w")
    faulthandler.enable(file=f, all_threads=True)
    try:
        yield
    finally:
        faulthandler.disable()
        if was:  # as python -X faulthandler (or pytest) had it
            with contextlib.suppress(Exception):
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
        f.close()
        os.remove(path)


def run(cfg: PlaitConfig, progress: bool = True, checked: bool = False) -> dict[str, float]:
    """Build and train; with trainer.max_restarts, a crash that is not the user's (RunError.recoverable: a
    worker process or the rollout engine that died) resumes from the newest checkpoint that verifies and
    loads, up to that many times, each restart one line (AReaL's recover.retries)."""
    with output_dir_lock(cfg.output_dir) as lock, crash_log(cfg.output_dir):  # before build: it writes data there
        print(f"plait: outputs in {cfg.output_dir}", file=sys.stderr)
        for restart in range(cfg.trainer.max_restarts + 1):
            if restart:
                os.utime(lock)  # newer than the failed attempt's summary.json: the run goes on (`profile report --watch`)
            try:
                return build(cfg, progress=progress, checked=checked or restart > 0).run()
            except RunError as err:
                if not err.recoverable or restart == cfg.trainer.max_restarts:
                    raise
                steps = checkpoint_steps(os.path.join(cfg.output_dir, "checkpoints"))
                print(f"plait: restart {restart + 1} of {cfg.trainer.max_restarts} (trainer.max_restarts) after: {err}; "
                      + (f"resuming from the newest checkpoint (step {max(steps)})" if steps else
                         "no checkpoint yet, so from step 1"), file=sys.stderr)
                cfg = copy.deepcopy(cfg)  # the same run, resumed: from its own newest checkpoint
                cfg.trainer.resume_mode, cfg.trainer.resume_from_path = "auto", None
    raise AssertionError("unreachable: the last attempt returns or raises")
