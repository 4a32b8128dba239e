"""From a config to a trainer: one flat table (`TRAINERS`, at the bottom), for each mode of plait/modes.py the
function that builds its trainer from (config, backend, device, tracker).

    driver.build ─▶ TRAINERS[trainer.mode](cfg, backend, device, tracker) ─▶ a Trainer for the lifecycle
                     sync · one_step_off · fully_async · colocate_async · separate_async: build_lm_trainer
                     below with the mode's class
                     diffusion: build_diffusion_trainer below (flow model, conditions, image reward)

Each builder resolves its model and data here: the language-model modes' (resolve_model, load_lm_data,
then the roles) and the diffusion mode's (flow model, conditions, image reward). A new mode is a row in
plait/modes.py (its facts) and one here (its trainer).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import partial
from typing import Callable

from plait.config import PlaitConfig, check_kept_set
from plait.modes import COLOCATE_ASYNC, DIFFUSION, FULLY_ASYNC, ONE_STEP_OFF, SEPARATE_ASYNC, SYNC
from plait.configtree import ConfigError
from plait.data.images import IMAGE_REWARDS, PROMPT_IMAGE_REWARDS, clip_score, condition_split
from plait.data.prompts import load_prompts
from plait.data.rewards import load_custom_reward
from plait.trainers.diffusion import Conditions, DiffusionTrainer
from plait.trainers.fully_async import FullyAsyncTrainer
from plait.data.dataset import PromptDataset, load_dataset
from plait.data.rewards import resolve_reward
from plait.models import load_tokenizer, reward_model_kind, use_chat_template
from plait.models_vl import is_vl_dir, load_processor
from plait.trainers.lm import LMTrainer, Roles
from plait.workers.actor import Actor
from plait.workers.critic import Critic
from plait.workers.judge import Judge
from plait.workers.engine import ENGINES
from plait.workers.precision import resolve_dtype
from plait.workers.ref import Ref
from plait.workers.reward_model import RewardModel
from plait.workers.rollout import Rollout
from plait.workers.teacher import Route, Teacher, TeacherSpec, route_value
from plait.algorithms.distillation import DistillationKnobs
from plait.trainers.one_step_off import OneStepOffTrainer
from plait.trainers.sync import SyncTrainer
from plait.trainers.v1_async import ColocateAsyncTrainer, V1AsyncTrainer
from plait.workers.diffusers_policy import is_diffusers_policy
from plait.workers.diffusion import DiffusionActor, DiffusionRef, policy_config, pretrain_flow_model
from plait.workers.diffusion_pipeline import check_pipeline_folder, pipeline_class


def resolve_flow_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights: the user's folder, or the built-in model pre-trained once and cached."""
    d = cfg.diffusion
    if d.model_path is not None and pipeline_class(d.model_path) is not None:
        try:
            check_pipeline_folder(d.model_path)
        except ValueError as err:
            raise ConfigError("diffusion.model_path", d.model_path, str(err)) from None
        return d.model_path
    if d.model_path is not None and is_diffusers_policy(d.model_path):
        return d.model_path
    if d.lora.enable:
        raise ConfigError("diffusion.lora.enable", True, "needs diffusion.model_path to be a diffusers policy "
                          "or pipeline folder")
    if d.model_path is not None:
        if not os.path.isfile(os.path.join(d.model_path, "settings.json")):
            raise ConfigError("diffusion.model_path", d.model_path, "not a folder saved by pretrain_flow_model "
                              "(settings.json, model.pt), a diffusers policy (plait_diffusers_policy.json) or a "
                              "diffusers pipeline (model_index.json)")
        return d.model_path
    out = os.path.join(cfg.output_dir, "demo_model", "flow")
    return str(pretrain_flow_model(d.model, d.pretrain_steps, d.pretrain_batch_size, d.pretrain_lr,
                                   cfg.trainer.seed, out))


def resolve_conditions(cfg: PlaitConfig, model_path: str) -> tuple[Conditions, Conditions]:
    """(training, validation) conditions: prompt rows for a pipeline, else class-id splits."""
    data = cfg.data
    if pipeline_class(model_path) is None:
        num_classes = policy_config(model_path).num_classes
        return condition_split("train", data.train_size, num_classes), condition_split("val", data.val_size, num_classes)
    if not data.train_files:
        raise ConfigError("data.train_files", data.train_files, "a prompt file (parquet/JSONL rows with "
                          f"{data.prompt_key!r}) is needed to train the pipeline in diffusion.model_path")
    try:
        train = load_prompts(data.train_files, data.prompt_key)
        val = load_prompts(data.val_files, data.prompt_key) if data.val_files else train[:data.val_size]
    except ValueError as err:
        raise ConfigError("data.train_files", data.train_files, str(err)) from None
    media = (data.image_key, data.video_key, data.audio_key)
    refuse_media("data.train_files", data.train_files, train, media)
    refuse_media("data.val_files" if data.val_files else "data.train_files", data.val_files or data.train_files, val, media)
    return train, val


def refuse_media(key: str, files, rows: list, columns: tuple[str, ...]) -> None:
    """A prompt row holding images, videos or audio is a ConfigError: a text-to-image pipeline generates from
    the prompt alone and would drop them without a word."""
    for i, row in enumerate(rows):
        held = [c for c in columns if row.metadata.get(c) not in (None, [], {}, "")]
        if held:
            raise ConfigError(key, files, f"prompt row {i}: column {held[0]!r} holds media; trainer.mode=diffusion "
                              "generates from the text prompt alone and would drop it: remove the column's values")


def resolve_image_reward(cfg: PlaitConfig, prompted: bool) -> tuple[str, Callable]:
    """The reward's name and function: the user's file, or a built-in of the kind the model needs."""
    d, custom = cfg.diffusion, cfg.reward.custom_reward_function
    if custom.path:
        return custom.name, load_custom_reward(custom.path, custom.name)
    builtins = [*PROMPT_IMAGE_REWARDS, "clip_score"] if prompted else list(IMAGE_REWARDS)
    if d.reward not in builtins:
        kind = "a text-to-image pipeline" if prompted else "a class-conditioned model"
        raise ConfigError("diffusion.reward", d.reward, f"with {kind} one of {', '.join(builtins)}")
    if d.reward == "clip_score":
        return d.reward, clip_score(d.reward_model_path)
    return d.reward, (PROMPT_IMAGE_REWARDS if prompted else IMAGE_REWARDS)[d.reward]


def build_diffusion_trainer(cfg: PlaitConfig, backend, device: str, tracker) -> DiffusionTrainer:
    """Model, conditions, reward and the roles (actor; ref for a full fine-tune with a KL), handed to the
    trainer. `tracker` is not used: validation images go to the trainer's own files and TensorBoard writer."""
    if cfg.algorithm.adv_estimator != "grpo":
        raise ConfigError("algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                          "must be grpo with trainer.mode=diffusion (Flow-GRPO's group advantages)")
    d = cfg.diffusion
    model_path = resolve_flow_model(cfg)
    train_conds, val_conds = resolve_conditions(cfg, model_path)
    reward_name, reward_fn = resolve_image_reward(cfg, isinstance(train_conds, list))
    actor = backend.spawn("actor", DiffusionActor, model_path, d.actor, device=device, lora=d.lora, pipeline=d.pipeline)
    ref = None
    if d.actor.kl_loss_coef > 0 and not d.lora.enable:
        ref = backend.spawn("ref", DiffusionRef, model_path, device=device, pipeline=d.pipeline)
    return DiffusionTrainer(cfg, actor, ref, reward_name, reward_fn, train_conds, val_conds, backend.profile_targets())


# -- the language-model modes ----------------------------------------------------------------


def resolve_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights, with `model.override_config` set over their config (models.config_overlay)."""
    from plait.models import config_overlay
    path, overrides = base_model(cfg), cfg.actor_rollout_ref.model.override_config
    if not overrides:
        return path
    folder = config_overlay(path, overrides, os.path.join(cfg.output_dir, "model_override"))
    print(f"plait: actor_rollout_ref.model.override_config {overrides} set over {path}'s config: {folder}", file=sys.stderr)
    return folder


def base_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights, then `warmstart.steps` of supervised training on the task's tool
    transcripts when asked (plait/agents/warmstart.py; cached)."""
    path, ws = start_model(cfg), cfg.warmstart
    if ws.steps == 0:
        return path
    from plait.agents.warmstart import transcript_warmstart
    print(f"plait: warmstart.steps={ws.steps}: supervised steps on {cfg.data.task}'s calculator transcripts "
          f"(loss on assistant tokens only) before RL", file=sys.stderr)
    return transcript_warmstart(path, cfg.data.task, os.path.join(cfg.output_dir, "warmstart"), steps=ws.steps,
                                batch_size=ws.batch_size, lr=ws.lr, seed=cfg.trainer.seed)


def start_model(cfg: PlaitConfig) -> str:
    """The user's directory, a built-in model (built once, cached), or the demo model warm-started
    once and cached."""
    from plait.data.warmstart import sft_warmstart
    from plait.builtin_models import builtin_model
    from plait.models import create_tiny_model
    path = cfg.actor_rollout_ref.model.path
    builtin = builtin_model(path)
    if builtin is not None:
        folder = builtin.build()
        print(f"plait: actor_rollout_ref.model.path={path}: {folder}", file=sys.stderr)
        return folder
    if path is not None:
        return path  # checked by driver.preflight
    demo = cfg.demo
    cache = os.path.join(cfg.output_dir, "demo_model")
    base = create_tiny_model(os.path.join(cache, f"init_{demo.model_size}"), size=demo.model_size, seed=cfg.trainer.seed)
    if demo.warmstart_steps == 0:
        return base
    return sft_warmstart(base, cfg.data.task, os.path.join(cache, "warmstart"), steps=demo.warmstart_steps,
                         batch_size=demo.warmstart_batch_size, lr=demo.warmstart_lr, seed=cfg.trainer.seed)


def check_vocabulary(model_path: str, tokenizer) -> None:
    """A tokenizer with more tokens than the model's embedding would index past it in the first step."""
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_path, local_files_only=True).get_text_config().vocab_size
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError("actor_rollout_ref.model.path", model_path,
                          f"the model's vocabulary has {vocab} tokens but its tokenizer has {len(tokenizer)}: ids "
                          f"from {vocab} on have no embedding; use the tokenizer the model was trained with")


def resolve_data(cfg: PlaitConfig) -> tuple[list[str], list[str] | None]:
    from plait.data.tasks import write_task_files
    d = cfg.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    train, val = write_task_files(d.task, os.path.join(cfg.output_dir, "data"), d.train_size, d.val_size, d.seed)
    return [train], [val]


def check_images(cfg: PlaitConfig, agent_loops: bool, *datasets) -> None:
    """Rows with images need an engine that takes them and single-turn generation: a ConfigError otherwise."""
    if not any(it.multi_modal for d in datasets if d is not None for it in d.items):
        return
    name = cfg.actor_rollout_ref.rollout.name
    why = ENGINES[name].images()
    if why:
        raise ConfigError("actor_rollout_ref.rollout.name", name, f"{why} (docs/vlm.md)")
    if agent_loops:
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable", True, "agent loops with images are not "
                          "implemented; rows with images run single-turn generation (drop the agent loop keys)")


def uses_agent_loops(cfg: PlaitConfig, *datasets) -> bool:
    """Rows run agent loops (plait/agents) when the rollout.multi_turn / rollout.agent keys ask for them or
    a row names its loop in an agent_name column; otherwise plain generation (single_turn_agent's result)."""
    names = {it.agent_name for d in datasets if d is not None for it in d.items if it.agent_name}
    agent = cfg.actor_rollout_ref.rollout.agent
    if not (cfg.actor_rollout_ref.rollout.agent_loops or names):
        return False
    from plait.agents.tools import tools_kwargs_problem
    from plait.agents.worker import check_agent_names
    check_agent_names(agent.agent_loop_config_path, agent.default_agent_loop, names,
                      cfg.actor_rollout_ref.rollout.multi_turn.format, agent.openai_agent)
    for split, d in zip(("data.train_files", "data.val_files"), datasets):
        for it in d.items if d is not None else []:
            problem = tools_kwargs_problem((it.extra_info or {}).get("tools_kwargs"))
            if problem is not None:  # else every call of the row would fail, blamed on its tool
                raise ConfigError(split, getattr(cfg.data, split.split(".")[1]),
                                  f"row {it.index}: extra_info.tools_kwargs{problem} (verl's form)")
    return True


def build_lm_trainer(cfg: PlaitConfig, backend, device: str, tracker, mode: type[LMTrainer]) -> LMTrainer:
    """Model, data, reward and the four language-model roles, handed to the trainer `mode` (a row of TRAINERS).
    In order: the model's folder, its tokenizer and the data (both checked before any model loads), the
    schedule's length, then the roles."""
    judge = resolve_judge(cfg)
    reward_fn = resolve_reward(cfg.reward, cfg.data.max_response_length, cfg.trainer.experiment_name or cfg.trainer.mode,
                               judge)
    model_path = resolve_model(cfg)
    tokenizer = load_lm_tokenizer(cfg, model_path)
    train_data, val_data = load_lm_data(cfg, model_path, tokenizer)
    agent_loops = uses_agent_loops(cfg, train_data, val_data)  # unknown agent names: a config error, before any model
    check_images(cfg, agent_loops, train_data, val_data)
    check_kept_set(cfg.actor_rollout_ref.rollout, cfg.trainer.mode, agent_loops)  # rows may name an agent loop
    teachers = resolve_teachers(cfg, model_path, tokenizer, train_data, device) if cfg.distillation.enabled else None
    resolve_schedule(cfg, len(train_data))
    roles = spawn_lm_roles(cfg, backend, device, model_path, tokenizer, agent_loops, judge)
    if teachers is not None:
        roles.teacher = spawn_teacher(cfg, backend, device, teachers)
    return mode(cfg, roles, tokenizer, train_data, val_data, reward_fn, backend.profile_targets(), tracker)


def resolve_judge(cfg: PlaitConfig) -> str | None:
    """The judge's folder when the reward model is a causal LM a reward function asks (a built-in name built on
    first use); None for a classifier or no reward model (preflight refused the rest)."""
    rm, custom = cfg.reward.reward_model, cfg.reward.custom_reward_function
    if not rm.enable:
        return None
    from plait.builtin_models import builtin_model
    builtin = builtin_model(rm.model_path)
    if builtin is not None:
        folder = builtin.build()
        print(f"plait: reward.reward_model.model_path={rm.model_path}: {folder}", file=sys.stderr)
        return folder
    if reward_model_kind(rm.model_path, bool(custom.path)) == "judge":
        return rm.model_path
    unread = [f"reward.reward_model.rollout.{f.name}" for f in dataclasses.fields(rm.rollout)
              if f.name != "name" and getattr(rm.rollout, f.name) != f.default]
    if unread:  # verl serves a classifier from its rollout engine too; plait scores it in its reward_model role
        print(f"plait: {', '.join(unread)}: no effect with a classifier reward model (plait scores it in its "
              "reward_model role; the rollout block serves a judge)", file=sys.stderr)
    return None


def load_lm_tokenizer(cfg: PlaitConfig, model_path: str):
    """The model folder's tokenizer, checked against the model's vocabulary, with model.custom_chat_template."""
    try:
        tokenizer = load_tokenizer(model_path)
    except (OSError, ValueError) as err:  # the files exist (preflight) but do not load
        raise ConfigError("actor_rollout_ref.model.path", model_path,
                          f"its tokenizer does not load ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    check_vocabulary(model_path, tokenizer)
    use_chat_template(tokenizer, cfg.actor_rollout_ref.model.custom_chat_template)
    return tokenizer


def load_lm_data(cfg: PlaitConfig, model_path: str, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and validation prompts, tokenized (with a VL model's processor for rows with images)."""
    train_files, val_files = resolve_data(cfg)
    d = cfg.data
    options = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                   filter_overlong_prompts=d.filter_overlong_prompts, return_raw_chat=d.return_raw_chat,
                   reward_fn_key=d.reward_fn_key, chat_template_kwargs=d.apply_chat_template_kwargs,
                   media_keys={"data.image_key": d.image_key, "data.video_key": d.video_key, "data.audio_key": d.audio_key},
                   processor=load_processor(model_path, tokenizer) if is_vl_dir(model_path) else None,
                   image_patch_size=d.image_patch_size)
    if d.custom_cls.path:  # the user's class reads the files (plait/data/custom_dataset.py)
        from plait.data.custom_dataset import load_custom_dataset
        hf_processor = hf_vl_processor(model_path) if options["processor"] is not None else None
        load = partial(load_custom_dataset, cfg, hf_processor=hf_processor)
    else:
        load = load_dataset
    train_data = load("data.train_files", train_files, tokenizer, **options)
    val_data = load("data.val_files", val_files, tokenizer, **options) if val_files else None
    if d.filter_overlong_prompts:
        print(f"plait: data.filter_overlong_prompts dropped {train_data.filtered} training and "
              f"{val_data.filtered if val_data else 0} validation prompts longer than "
              f"max_prompt_length={d.max_prompt_length}", file=sys.stderr)
    if len(train_data) < d.train_batch_size:  # before any model loads
        raise ConfigError("data.train_batch_size", d.train_batch_size,
                          f"larger than the training set ({len(train_data)} prompts in {', '.join(map(str, train_files))}); "
                          "lower it or add prompts")
    return train_data, val_data


def hf_vl_processor(model_path: str):
    """transformers' processor of a vision-language model folder: what verl hands a data.custom_cls class."""
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_path, local_files_only=True)


def resolve_schedule(cfg: PlaitConfig, n_train: int) -> None:
    """As verl: an optimizer's lr schedule spans the trainer's steps unless its total_training_steps is set."""
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        if optim.total_training_steps == -1:
            optim.total_training_steps = cfg.total_steps(n_train // cfg.data.train_batch_size)


def spawn_lm_roles(cfg: PlaitConfig, backend, device: str, model_path: str, tokenizer, agent_loops: bool,
                   judge: str | None = None) -> Roles:
    """The actor, rollout, ref, critic and reward model (a classifier, or a causal LM served as a judge from the
    folder `judge`), each spawned on the backend (None where not used)."""
    arr = cfg.actor_rollout_ref
    dtype = resolve_dtype("actor_rollout_ref.model.dtype", arr.model.dtype, device)
    rollout_dtype = dtype if arr.rollout.dtype == arr.model.dtype else resolve_dtype(
        "actor_rollout_ref.rollout.dtype", arr.rollout.dtype, device)
    temp, n = arr.rollout.temperature or 1.0, arr.rollout.n
    model, critic, rm = arr.model, cfg.critic, cfg.reward.reward_model
    lora = model.lora_rank > 0  # the actor's base model with adapters off is the reference: no Ref role
    budget = lambda dynamic, tokens: tokens if dynamic else None  # noqa: E731  use_dynamic_bsz: a token budget
    return Roles(
        actor=backend.spawn("actor", Actor, model_path, arr.actor, n, temp, device=device, dtype=dtype, seed=cfg.trainer.seed,
                            remove_padding=model.use_remove_padding,
                            max_token_len=budget(arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu),
                            gradient_checkpointing=model.enable_gradient_checkpointing, model_cfg=model,
                            distill=distillation_knobs(cfg) if cfg.distillation.enabled else None),
        rollout=backend.spawn("rollout", Rollout, model_path, cfg.data.max_response_length, tokenizer, device=device,
                              dtype=rollout_dtype, ignore_eos=arr.rollout.ignore_eos, cfg=arr.rollout,
                              colocated=cfg.trainer.placement == "colocated",
                              agent_cfg=cfg if agent_loops else None),
        ref=backend.spawn("ref", Ref, model_path, arr.ref, temp, device=device, dtype=dtype,
                          remove_padding=model.use_remove_padding,
                          max_token_len=budget(arr.ref.log_prob_use_dynamic_bsz, arr.ref.log_prob_max_token_len_per_gpu))
        if cfg.uses_ref and not lora else None,
        critic=(backend.spawn("critic", Critic, critic.model.path or model_path, critic, n, device=device, dtype=dtype,
                              remove_padding=critic.model.use_remove_padding,
                              max_token_len=budget(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
                              forward_max_token_len=budget(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu),
                              gradient_checkpointing=critic.model.enable_gradient_checkpointing)
                if critic.enable else None),
        reward_model=(backend.spawn("reward_model", RewardModel, rm.model_path, tokenizer, micro_batch_size=rm.micro_batch_size_per_gpu,
                                    max_length=rm.max_length, input_tokenizer=rm.input_tokenizer, device=device, dtype=dtype,
                                    strategy=arr.actor.strategy, fsdp_config=arr.actor.fsdp_config)
                      if rm.enable and judge is None else None),
        judge=(backend.spawn("reward_model", Judge, judge, rm.rollout, device=device, dtype=resolve_dtype(
            "reward.reward_model.rollout.dtype", rm.rollout.dtype or model.dtype, device)) if judge else None))


def distillation_knobs(cfg: PlaitConfig) -> DistillationKnobs:
    loss = cfg.distillation.distillation_loss
    return DistillationKnobs(loss_mode=loss.loss_mode, use_task_rewards=loss.use_task_rewards,
                             coef=loss.distillation_loss_coef, loss_max_clamp=loss.loss_max_clamp,
                             log_prob_min_clamp=loss.log_prob_min_clamp, use_policy_gradient=loss.use_policy_gradient,
                             clip_low=loss.clip_low, clip_high=loss.clip_high)


def resolve_teachers(cfg: PlaitConfig, model_path: str, tokenizer, train_data: PromptDataset,
                     device: str) -> dict[str, TeacherSpec]:
    """The teachers by routing key, each a local folder (a built-in model built once), checked before any
    model loads: it reads the student's token ids, so its tokenizer must be the student's (its embedding
    must cover them, and a top-k teacher's vocabulary may not pass the student's); every training row's
    routing value must name a teacher."""
    from transformers import AutoConfig
    from plait.builtin_models import builtin_model
    d = cfg.distillation
    names = {id(t): name for name, t in d.teacher_models.items()}
    student_vocab = AutoConfig.from_pretrained(model_path, local_files_only=True).get_text_config().vocab_size
    specs = {}
    for key, t in d.teachers().items():
        name = f"distillation.teacher_models.{names[id(t)]}"
        builtin = builtin_model(t.model_path)
        path = builtin.build() if builtin is not None else t.model_path
        check_teacher_vocabulary(f"{name}.model_path", path, tokenizer, student_vocab, d.distillation_loss.loss_mode)
        dtype = resolve_dtype(f"{name}.inference.dtype", t.inference.dtype, device)
        specs[key] = TeacherSpec(path, f"{name}.model_path", dtype, t.inference.max_num_batched_tokens)
    check_routes(cfg, train_data, set(specs))
    return specs


def check_teacher_vocabulary(key: str, path: str, tokenizer, student_vocab: int, loss_mode: str) -> None:
    from transformers import AutoConfig
    from plait.models import TOKENIZER_FILES
    if any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        theirs = load_tokenizer(path)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(key, path, "its tokenizer is not the student's: the teacher scores the student's token "
                              "ids, so both must share one vocabulary (verl's teachers read the ids too)")
    vocab = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config().vocab_size
    if vocab < len(tokenizer) or (loss_mode == "forward_kl_topk" and vocab > student_vocab):
        raise ConfigError(key, path, f"the teacher's vocabulary has {vocab} tokens, the student's tokenizer "
                          f"{len(tokenizer)} and its model {student_vocab}: a teacher must cover the student's ids"
                          + (" and, for the top-k loss, pick none the student does not have" if vocab >= len(tokenizer) else ""))


def check_routes(cfg: PlaitConfig, data: PromptDataset, keys: set) -> None:
    """Several teachers: every training row's routing value (distillation.teacher_key) names one."""
    d = cfg.distillation
    if len(keys) == 1 and "default" in keys:
        return
    column = teacher_column(cfg)
    values = {it.data_source if column is None else route_value(it.extra_info.get(column)) for it in data.items}
    missing = sorted(map(str, values - keys))
    if missing:
        raise ConfigError("distillation.teacher_key", d.teacher_key,
                          f"training rows have {d.teacher_key} value(s) {', '.join(missing[:5])} that no teacher's key "
                          f"names (teachers: {', '.join(sorted(keys))}); add a teacher for them or drop the rows")


def teacher_column(cfg: PlaitConfig) -> str | None:
    """None: the teachers route by the rows' data_source (data.reward_fn_key's column); else the extra_info key."""
    key = cfg.distillation.teacher_key
    return None if key == cfg.data.reward_fn_key else key


def spawn_teacher(cfg: PlaitConfig, backend, device: str, teachers: dict[str, TeacherSpec]):
    """The teacher role: every teacher on each of its workers (the actor's, or distillation's own pool on Ray)."""
    loss = cfg.distillation.distillation_loss
    route = Route(teacher_column(cfg), next(iter(teachers)) if list(teachers) == ["default"] else None)
    return backend.spawn("teacher", Teacher, teachers, loss.topk if loss.loss_mode == "forward_kl_topk" else 0, route,
                         device=device, remove_padding=cfg.actor_rollout_ref.model.use_remove_padding)


TRAINERS = {  # plait/modes.py holds each mode's facts; here, the function that builds its trainer
    SYNC: partial(build_lm_trainer, mode=SyncTrainer),
    ONE_STEP_OFF: partial(build_lm_trainer, mode=OneStepOffTrainer),
    FULLY_ASYNC: partial(build_lm_trainer, mode=FullyAsyncTrainer),
    COLOCATE_ASYNC: partial(build_lm_trainer, mode=ColocateAsyncTrainer),  # verl 0.9.1's V1 modes
    SEPARATE_ASYNC: partial(build_lm_trainer, mode=V1AsyncTrainer),
    DIFFUSION: build_diffusion_trainer,
}
