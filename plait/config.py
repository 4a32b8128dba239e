"""The config tree: one typed dataclass per node, verl's key names, nesting and defaults, plait's extras.

`load_config(path, overrides)` merges the defaults, the demo preset (configs/demo.yaml, when
`actor_rollout_ref.model.path` is null), an optional YAML file and verl-style overrides, then
builds the tree with `configtree.build`: every wrong key, type or value of one load is reported
together, each naming the key, the value and what would be valid. verl keys with no effect here
(config_verl.py) are taken out first and named once at start. Nodes owned by a component (the
profiler's, diffusion's) are imported from beside it. Cross-node rules (batch sizes that must
divide, modes that need a placement, verl's inherited defaults) live in `PlaitConfig.__post_init__`,
the one place that sees the whole tree.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

# names only (no torch): a config error is reported before torch and transformers load
from plait.algorithms.names import (BYPASS_LOSS_TYPES, ESTIMATOR_NAMES as ESTIMATORS, IS_LEVELS,
                                    KL_ESTIMATOR_NAMES as KL_ESTIMATORS, LOSS_AGG_MODES,
                                    POLICY_LOSS_NAMES as POLICY_LOSSES, parse_is_threshold, parse_rs)
from plait.config_verl import (CPU_NO_EFFECT, CPU_RAY_NO_EFFECT, FIELD_NO_EFFECT, LEGACY_REWARD,
                               LOCAL_BACKEND_NO_EFFECT, NO_EFFECT, RECIPE_ROLLOUT_POOL, compose_yaml, drop_empty,
                               load_yaml, machine_notes, merge, refusal, resolve_interpolations)
from plait.configtree import ConfigError, build, ConfigErrors, build_without, check, raise_all, to_dict
from plait.configtree import shipped_tool_config  # noqa: F401 - config's name for it (tools, agents)
from plait.data.rewards import RewardConfig
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
from plait.modes import ASYNC_MODES, MODES, SEPARATE_ASYNC, SYNC, V1_MODES
from plait.trainers.v1_config import V1Config
from plait.workers.diffusion_config import DiffusionConfig
from plait.workers.distillation_config import (DistillationConfig, check_lengths, no_effect as distillation_no_effect,
                                               notes as distillation_notes)
from plait.workers.engine import ENGINES, default_engine, engine_no_effect, unset_note


def one_of(node, name: str, options) -> None:
    """Field `name` of `node` must be one of `options` (the algorithms' own name tables)."""
    value = getattr(node, name)
    check(value in options, name, value, f"one of {', '.join(options)}")


def positive(node, *names: str) -> None:
    """Each named field of `node` must be > 0."""
    for name in names:
        value = getattr(node, name)
        check(value > 0, name, value, "must be > 0")


@dataclass
class CustomDatasetConfig:
    """`data.custom_cls`: a user's torch Dataset class that reads data.train_files / val_files itself
    (plait/data/custom_dataset.py)."""
    path: Optional[str] = None                # a Python file, or pkg://module.path (verl's load_extern_object forms)
    name: Optional[str] = None                # the class in it

    def __post_init__(self):
        check(self.name is not None or self.path is None, "name", self.name, "the dataset class's name when path is set")


@dataclass
class DataConfig:
    train_files: Optional[list[str]] = None  # null: the built-in task named by `task`
    val_files: Optional[list[str]] = None
    task: str = "arithmetic"                  # built-in task used when the files are null
    train_size: int = 2048                    # rows generated for the built-in task
    val_size: int = 128
    train_batch_size: int = 1024              # prompts per step (each sampled rollout.n times)
    val_batch_size: Optional[int] = None      # null: the whole validation set in one batch
    max_prompt_length: int = 512
    max_response_length: int = 512
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"        # the column that selects the rule reward
    truncation: Literal["error", "left", "right", "middle"] = "error"
    filter_overlong_prompts: bool = False
    return_raw_chat: bool = True
    shuffle: bool = True
    seed: Optional[int] = None                # null: trainer.seed
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the chat template
    image_key: str = "images"                 # a row's images (Qwen2-VL / Qwen2.5-VL policies; a text model refuses them)
    video_key: str = "videos"                 # verl's video and audio columns: a row holding any is refused
    audio_key: str = "audios"                 #   (training would drop them without a word)
    image_patch_size: int = 14                # images are resized to multiples of 2 x this (verl's process_image)
    custom_cls: CustomDatasetConfig = field(default_factory=CustomDatasetConfig)
    gen_batch_size: Optional[int] = None      # verl 0.9.1's V1 fetch size: prompts per generate call of the V1 async modes

    def __post_init__(self):
        check(self.gen_batch_size is None or self.gen_batch_size > 0, "gen_batch_size", self.gen_batch_size,
              "must be > 0 or null")
        # 0 is verl's fully-async setting (the rollouter streams); PlaitConfig checks the mode and sizes it
        check(self.train_batch_size >= 0, "train_batch_size", self.train_batch_size, "must be > 0 (or 0 with trainer.mode=fully_async)")
        positive(self, "max_prompt_length", "max_response_length", "train_size", "val_size")
        check(self.val_batch_size is None or self.val_batch_size > 0, "val_batch_size", self.val_batch_size, "must be > 0 or null")


@dataclass
class DemoConfig:
    """The built-in demo model, used when `actor_rollout_ref.model.path` is null."""
    model_size: Literal["xs", "s", "m"] = "s"
    warmstart_steps: int = 250                # supervised warm start to ~5-20 % accuracy, so RL has room
    warmstart_lr: float = 1e-3
    warmstart_batch_size: int = 32

    def __post_init__(self):
        check(self.warmstart_steps >= 0, "warmstart_steps", self.warmstart_steps, "must be >= 0")
        positive(self, "warmstart_lr", "warmstart_batch_size")


@dataclass
class WarmStartConfig:
    """plait's own `warmstart`: supervised steps on the task's generated tool transcripts before RL
    (plait/agents/warmstart.py: loss on assistant tokens only, tool messages attended), applied to
    whatever model the run starts from; cached in <output dir>/warmstart. 0 steps: none."""
    steps: int = 0
    batch_size: int = 8
    lr: float = 1.0e-5

    def __post_init__(self):
        check(self.steps >= 0, "steps", self.steps, "must be >= 0 (0: no warm start)")
        positive(self, "batch_size", "lr")


@dataclass
class ModelConfig:
    path: Optional[str] = None                # a local Hugging Face causal LM directory; null: the demo model (configs/demo.yaml)
    # the workers' compute dtype (weights and optimizer state stay float32, plait/workers/precision.py);
    # auto: bfloat16 where the device computes it fast, else float32
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = True
    use_remove_padding: bool = True
    lora_rank: int = 0                        # 0: full fine-tuning
    lora_alpha: int = 16
    target_modules: Union[str, list[str]] = "all-linear"
    lora_adapter_path: Optional[str] = None   # a saved peft adapter to start from (with lora_rank > 0)
    exclude_modules: Union[str, list[str], None] = None  # modules target_modules matches that get no adapter (peft)
    override_config: dict[str, Any] = field(default_factory=dict)  # set over the checkpoint's config.json (verl's)
    custom_chat_template: Optional[str] = None  # a Jinja chat template used instead of the tokenizer's (verl's)

    def __post_init__(self):
        check(self.lora_rank >= 0, "lora_rank", self.lora_rank, "0 (off) or the LoRA rank")
        check(self.custom_chat_template is None or (isinstance(self.custom_chat_template, str) and
                                                    self.custom_chat_template.strip() != ""),
              "custom_chat_template", self.custom_chat_template, "null or a Jinja chat template (a string)")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1                 # -1: lr_warmup_steps_ratio x total_training_steps
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1            # -1: the trainer's step count
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    warmup_style: Optional[str] = None        # verl's older name for lr_scheduler_type
    clip_grad: float = 1.0
    zero_indexed_step: bool = True            # false: the schedule's first step is step 1 (warmup starts above 0)

    def __post_init__(self):
        check(self.lr > 0, "lr", self.lr, "must be > 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas, "two numbers in [0, 1)")
        check(self.lr_warmup_steps >= -1, "lr_warmup_steps", self.lr_warmup_steps, "-1 (use the ratio) or >= 0")
        for name in ("lr_warmup_steps_ratio", "min_lr_ratio"):
            check(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        check(self.clip_grad > 0, "clip_grad", self.clip_grad, "must be > 0")


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None          # DRO's quadratic penalty; needed with loss_mode=dro

    def __post_init__(self):
        one_of(self, "loss_mode", (*POLICY_LOSSES, "bypass_mode"))  # bypass_mode: PlaitConfig maps it
        check(self.loss_mode != "dro" or (self.dro_beta or 0) > 0, "dro_beta", self.dro_beta, "> 0 with loss_mode=dro")
        positive(self, "clip_cov_ratio", "kl_cov_ratio")
        check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_ub", self.clip_cov_ub, f"must be > clip_cov_lb ({self.clip_cov_lb})")


STRATEGIES = ("fsdp", "fsdp2")


@dataclass
class WrapPolicyConfig:
    min_num_params: int = 0                   # a transformer block is sharded on its own only with this many parameters


# verl's names for FSDP2's mixed-precision dtypes, and torch's
MP_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32"}


@dataclass
class MixedPrecisionConfig:
    """verl's `fsdp_config.mixed_precision`: FSDP2's MixedPrecisionPolicy when sharded, else torch.autocast
    to param_dtype over float32 weights (plait/workers/precision.py)."""
    param_dtype: Optional[str] = None         # this role's compute dtype; null: actor_rollout_ref.model.dtype
    reduce_dtype: Optional[str] = None        # FSDP2's gradient reduce-scatter dtype; null: float32 (verl's)
    buffer_dtype: Optional[str] = None        # floating-point buffers (rotary frequencies); null: float32 (verl's)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            check(value is None or value in MP_DTYPES, name, value, f"null or one of {', '.join(MP_DTYPES)}")


@dataclass
class FsdpConfig:
    """`*.fsdp_config`: the FSDP2 knobs (plait/workers/parallel.py shard_model); sharding itself is `strategy`."""
    param_offload: bool = False               # CUDA: parameters, gradients and the optimizer step on CPU (CPUOffloadPolicy)
    optimizer_offload: bool = False           # CUDA: the optimizer state in CPU memory between steps (parameters stay)
    offload_policy: bool = False              # verl's FSDP2 name for that offload
    reshard_after_forward: bool = True        # free the gathered weights after each block's forward
    forward_prefetch: bool = False            # gather the next block's weights during this block's forward
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)  # FSDP2's MixedPrecisionPolicy

    def __post_init__(self):
        check(self.wrap_policy.min_num_params >= 0, "wrap_policy.min_num_params", self.wrap_policy.min_num_params,
              "must be >= 0")


SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointConfig:
    # verl's names. model, optimizer and extra (lr schedule, data order) are what a resume needs: plait
    # always writes them. hf_model adds actor/huggingface/: the policy as a Hugging Face folder (plait/export.py).
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])

    def __post_init__(self):
        bad = [c for c in self.save_contents if c not in SAVE_CONTENTS]
        check(not bad, "save_contents", self.save_contents, f"each one of {', '.join(SAVE_CONTENTS)}")
        check({"model", "optimizer", "extra"} <= set(self.save_contents), "save_contents", self.save_contents,
              "must keep model, optimizer and extra (a plait checkpoint always holds what a resume needs); "
              "add hf_model for a Hugging Face folder beside them")


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: str = "fsdp"                    # fsdp2: FSDP2 with >1 rank on any device; fsdp: FSDP2 on CUDA, whole replicas on CPU
    fsdp_config: FsdpConfig = field(default_factory=FsdpConfig)
    ppo_mini_batch_size: int = 256            # prompts per optimizer step (x rollout.n samples)
    freeze_vision_tower: bool = False         # a VL policy's vision encoder stays as loaded (not trained)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # samples per forward/backward; null: the whole mini-batch
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None    # null: clip_ratio
    clip_ratio_high: Optional[float] = None   # null: clip_ratio
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's constant length; null: data.max_response_length
    tau_pos: float = 1.0                      # SAPO's gate temperature for positive advantages
    tau_neg: float = 1.05                     # ... and for the others
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)

    def __post_init__(self):
        positive(self, "ppo_mini_batch_size", "ppo_epochs", "clip_ratio", "tau_pos", "tau_neg")
        one_of(self, "strategy", STRATEGIES)
        check(self.clip_ratio_c > 1, "clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
        one_of(self, "loss_agg_mode", LOSS_AGG_MODES)
        one_of(self, "kl_loss_type", KL_ESTIMATORS)
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")
        self.clip_ratio_low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        self.clip_ratio_high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        # the ratio is clipped to [1 - low, 1 + high]: a negative bound flips it, low >= 1 removes the floor
        check(self.clip_ratio <= 1, "clip_ratio", self.clip_ratio, "must be in (0, 1]")
        # CISPO's documented setting is clip_ratio_low=10: no floor on the ratio that weighs its gradient
        no_floor = self.policy_loss.loss_mode in ("cispo", "clip_cov")
        check(self.clip_ratio_low >= 0 and (no_floor or self.clip_ratio_low < 1), "clip_ratio_low", self.clip_ratio_low,
              "must be in [0, 1) (>= 1, no floor, with policy_loss.loss_mode cispo or clip_cov)")
        check(self.clip_ratio_high >= 0, "clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        check(self.ppo_micro_batch_size_per_gpu is None or self.ppo_micro_batch_size_per_gpu > 0,
              "ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu, "must be > 0 or null")
        positive(self, "ppo_max_token_len_per_gpu")
        check(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff, "must be >= 0 (an entropy bonus)")
        check(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True

    def __post_init__(self):
        check(self.n > 0, "n", self.n, "must be > 0")
        check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        check(self.top_k >= -1, "top_k", self.top_k, "-1 (off) or a positive integer")


def _val_sampling() -> SamplingConfig:
    return SamplingConfig(n=1, temperature=0.0, do_sample=False)


@dataclass
class EngineKwargsConfig:
    vllm: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as given, over plait's settings


TRUNCATE_SIDES = ("left", "right", "middle")
UNSUPPORTED_WHY = "is not implemented in plait's agent loops (docs/agents.md)"


@dataclass
class MultiTurnConfig:
    """`rollout.multi_turn`: the tool_agent loop's limits and tools (plait/agents, docs/agents.md)."""
    enable: bool = False                      # true: rows run agent loops (default_agent_loop unless agent_name)
    max_assistant_turns: Optional[int] = None  # null: no limit but the response budget
    max_user_turns: Optional[int] = None       # tool answers count as user turns
    max_parallel_calls: int = 1                # calls run per assistant turn (the first ones)
    max_tool_response_length: int = 256        # characters of a tool's text before truncation
    tool_response_truncate_side: str = "middle"
    tool_config_path: Optional[str] = None     # verl's tool YAML (class_name, config, tool_schema); a bare name
                                               # that is no path: a file shipped in plait/configs/tools/<name>.yaml
    function_tool_path: Optional[str] = None   # a Python file of @function_tool functions
    format: str = "hermes"
    tokenization_sanity_check_mode: str = "strict"  # the Continuous Token prefix check always runs
    interaction_config_path: Optional[str] = None  # verl's interaction YAML: a simulated user answers each turn
    use_inference_chat_template: bool = False
    num_repeat_rollouts: Optional[int] = None     # verl reads it nowhere; user agent loops may
    tool_timeout: Optional[float] = 60.0      # plait's own: seconds a call (create + execute + release) may take; null: none
    tool_num_workers: int = 2                 # plait's own: tool worker processes (calls in flight at once)

    def __post_init__(self):
        self.tool_config_path = shipped_tool_config(self.tool_config_path)
        check(self.tool_timeout is None or self.tool_timeout > 0, "tool_timeout", self.tool_timeout, "> 0 seconds or null")
        positive(self, "tool_num_workers")
        # verl reads `format` only where a row runs tool_agent (an unknown name stops its loop there): plait
        # checks the name at start against the rows' loops and its parsers (plait/agents/worker.py check_agent_names)
        check(isinstance(self.format, str) and bool(self.format), "format", self.format,
              "a tool-call format name (the parsers of plait/agents/tool_parser.py)")
        one_of(self, "tool_response_truncate_side", TRUNCATE_SIDES)
        for key in ("max_assistant_turns", "max_user_turns"):
            check(getattr(self, key) is None or getattr(self, key) >= 1, key, getattr(self, key), "an integer >= 1 or null")
        positive(self, "max_parallel_calls", "max_tool_response_length")
        check(self.tokenization_sanity_check_mode == "strict", "tokenization_sanity_check_mode",
              self.tokenization_sanity_check_mode, "strict: plait always checks that the chat template is prefix-stable")
        check(not self.use_inference_chat_template, "use_inference_chat_template", self.use_inference_chat_template,
              f"false: re-rendering turns with the inference template {UNSUPPORTED_WHY} (tokens are kept as sampled)")
        # verl 0.9.1's own code reads num_repeat_rollouts nowhere; a user agent loop may (verl-recipe's collabllm
        # loop does), and loops get this tree as verl's config: kept for them, as in verl
        check(self.num_repeat_rollouts is None or (isinstance(self.num_repeat_rollouts, int) and self.num_repeat_rollouts >= 1),
              "num_repeat_rollouts", self.num_repeat_rollouts, "null or an integer >= 1 (read only by user agent loops)")


@dataclass
class CustomAsyncServerConfig:
    path: Optional[str] = None
    name: Optional[str] = None

    def __post_init__(self):
        for key in ("path", "name"):
            check(getattr(self, key) is None, key, getattr(self, key),
                  "null: plait's rollout serves the loops from its own engine (custom async servers are not implemented)")


@dataclass
class OpenAIAgentConfig:
    """`rollout.agent.openai_agent` (plait's own): the agent the `openai_agent` loop trains through the gateway
    (plait/agents/openai_agent.py, docs/agents.md "Bring your own agent"). Give `path` (+ `name`) or `command`."""
    path: Optional[str] = None      # a Python file with `async def run(row, base_url, api_key)` (or a shipped
                                    # agent's name: react_calculator)
    name: str = "run"               # the function in `path`
    command: Optional[str] = None   # or a command line started per row (OPENAI_BASE_URL, ..., the row on stdin)
    timeout: float = 600.0          # seconds one session (the agent's whole run on a row) may take
    num_workers: int = 2            # processes running `path`'s function (each runs many sessions at once)
    memory_limit_mb: Optional[int] = None  # per agent process; null: reward.memory_limit_mb
    host: str = "127.0.0.1"         # where the gateway listens
    port: int = 0                   # 0: a free port

    def __post_init__(self):
        self.path = shipped_tool_config(self.path, "agents", ".py")  # react_calculator: shipped in plait/configs/agents
        check(self.path is None or self.command is None, "command", self.command,
              "null when openai_agent.path is set: give the agent as a function (path, name) or as a command, not both")
        check(self.path is None or os.path.isfile(self.path), "path", self.path,
              "a Python file defining the agent function (async def run(row, base_url, api_key))")
        check(isinstance(self.name, str) and self.name.isidentifier(), "name", self.name, "a Python function name")
        check(self.command is None or (isinstance(self.command, str) and self.command.strip() != ""), "command",
              self.command, "a command line")
        check(self.timeout > 0, "timeout", self.timeout, "> 0 seconds")
        positive(self, "num_workers")
        check(self.memory_limit_mb is None or self.memory_limit_mb > 0, "memory_limit_mb", self.memory_limit_mb,
              "> 0 MiB or null")
        check(0 <= self.port <= 65535, "port", self.port, "0 (a free port) to 65535")

    @property
    def given(self) -> bool:
        return self.path is not None or self.command is not None


@dataclass
class AgentConfig:
    """`rollout.agent`: which agent loop a row runs (plait/agents/worker.py)."""
    default_agent_loop: str = "single_turn_agent"  # for rows without an agent_name column
    agent_loop_config_path: Optional[str] = None    # YAML list of {name, _target_, **kwargs}
    num_workers: int = 8
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)
    openai_agent: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)  # plait's own

    def __post_init__(self):
        check(self.num_workers >= 1, "num_workers", self.num_workers, "verl's agent-loop workers: >= 1")  # named at start

    @property
    def on(self) -> bool:
        return self.default_agent_loop != "single_turn_agent" or self.agent_loop_config_path is not None


@dataclass
class RolloutConfig:
    # A row of plait/workers/engine.py's ENGINES (plait's own engine, vLLM's, ...).
    # null: vLLM when it is installed and a model path is set, else plait's own (said at start).
    name: Optional[str] = None
    mode: Literal["sync", "async"] = "async"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # null: the whole batch in one forward
    ignore_eos: bool = False                  # generate max_response_length tokens always (benchmarks)
    log_prob_use_dynamic_bsz: Optional[bool] = None      # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null: actor.ppo_max_token_len_per_gpu
    val_kwargs: SamplingConfig = field(default_factory=_val_sampling)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    # The engine's own settings, verl's names. Every engine reads dtype and calculate_log_probs;
    # the rest are vLLM's (with rollout.name=hf they are named at start as having no effect).
    dtype: Optional[str] = None               # null: actor_rollout_ref.model.dtype (verl: bfloat16)
    calculate_log_probs: bool = False         # rollout log-probs are always computed here (the loss needs them)
    gpu_memory_utilization: float = 0.5       # GPU only; on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None       # null: the model's own
    enforce_eager: bool = False               # always eager on CPU (the compile warm-up takes minutes)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True        # the cache is reset after every weight load
    free_cache_engine: bool = True            # GPU, colocated: vLLM sleeps (enable_sleep_mode) while the actor trains
    load_format: str = "auto"                 # dummy*: the model path's weights (what verl's first sync loads)
    seed: int = 0                             # vLLM's engine seed; each request also gets one from trainer.seed
    tensor_model_parallel_size: int = 1       # verl's default is 2; more than 1 needs CUDA and vLLM
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    # The rollout's own pool on Ray (verl's standalone rollout; the async recipes' rollout.nnodes and
    # rollout.n_gpus_per_node mean the same): 0 nodes: one process with one device. plait runs one
    # engine, so at most one node, whose n_gpus_per_node devices (CPU: cpus_per_worker slots) it holds.
    nnodes: int = 0
    n_gpus_per_node: int = 8
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    @property
    def agent_loops(self) -> bool:
        """Whether rows run through agent loops (plait/agents) rather than plain generation."""
        mt = self.multi_turn
        return mt.enable or mt.tool_config_path is not None or mt.function_tool_path is not None or self.agent.on

    def __post_init__(self):
        SamplingConfig(self.n, self.temperature, self.top_p, self.top_k, self.do_sample)  # same checks
        if self.name is not None:
            one_of(self, "name", tuple(ENGINES))
            why = ENGINES[self.name].unavailable()
            check(why is None, "name", self.name, why)
        check(self.dtype is None or self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
              "one of auto, float32, bfloat16, float16 or null (actor_rollout_ref.model.dtype)")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        for key in ("max_num_batched_tokens", "max_num_seqs", "tensor_model_parallel_size"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "an integer >= 1")
        check(self.nnodes in (0, 1), "nnodes", self.nnodes, "0 (one process, one device) or 1: plait's rollout is one "
              "engine on one node (data-parallel generation over several nodes is not implemented, docs/ray.md)")
        check(self.n_gpus_per_node >= 1, "n_gpus_per_node", self.n_gpus_per_node, "an integer >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len,
              "an integer >= 1 or null")
        check(self.log_prob_micro_batch_size_per_gpu is None or self.log_prob_micro_batch_size_per_gpu > 0,
              "log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu, "must be > 0 or null")


def check_kept_set(r: RolloutConfig, mode: str, agent_loops: bool) -> None:
    """Top-k / top-p sample from a kept set, and the trainer must take its log-probs over that same set, or it
    trains another distribution than the one sampled (the ratio's mean would be the kept mass). Where the set
    cannot reach the trainer the key is refused: both engines return it on their generate path; the agent loops
    (multi-turn, the gateway, rows naming a loop) do not carry it yet. `agent_loops`: the run's
    rows run agent loops (the config's keys, or build's look at the data)."""
    if not MODES[mode].lm or not r.do_sample or r.temperature == 0 or (r.top_p == 1 and r.top_k <= 0):
        return
    key, value = ("top_p", r.top_p) if r.top_p < 1 else ("top_k", r.top_k)
    why = ENGINES[r.name].kept_set or ("agent loops (multi_turn, the gateway, an agent_name column) do not carry "
                                       "the kept set to the trainer yet" if agent_loops else None)
    check(why is None, f"actor_rollout_ref.rollout.{key}", value,
          f"{'1' if key == 'top_p' else '-1'} with rollout.name={r.name}{' and agent loops' if agent_loops else ''}: "
          f"the trainer takes its log-probs over the set top-k / top-p kept, and {why} (plain generation carries it; "
          "val_kwargs may filter freely)")


def torch_cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass
class RefConfig:
    strategy: Optional[str] = None            # null: the actor's (as verl's ${actor_rollout_ref.actor.strategy})
    fsdp_config: FsdpConfig = field(default_factory=FsdpConfig)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # null: the whole batch in one forward
    log_prob_use_dynamic_bsz: Optional[bool] = None          # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None     # null: actor.ppo_max_token_len_per_gpu
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)

    def __post_init__(self):
        check(self.strategy is None or self.strategy in STRATEGIES, "strategy", self.strategy,
              f"null (the actor's) or one of {', '.join(STRATEGIES)}")
        check(self.log_prob_micro_batch_size_per_gpu is None or self.log_prob_micro_batch_size_per_gpu > 0,
              "log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu, "must be > 0 or null")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None                # null: the actor's model
    enable_gradient_checkpointing: bool = True
    use_remove_padding: bool = False
    trust_remote_code: bool = False
    fsdp_config: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None             # null: on exactly when the advantage estimator needs values (gae)
    strategy: str = "fsdp"                    # as actor_rollout_ref.actor.strategy
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 256                      # unset: the actor's (load_config)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # null: the whole mini-batch
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1                                 # unset: the actor's (load_config)
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"                   # unset: the actor's (load_config)
    loss_scale_factor: Optional[float] = None           # seq-mean-token-sum-norm's constant; unset: the actor's
    grad_clip: float = 1.0
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)

    def __post_init__(self):
        positive(self, "ppo_mini_batch_size", "ppo_epochs", "cliprange_value")
        one_of(self, "strategy", STRATEGIES)
        one_of(self, "loss_agg_mode", LOSS_AGG_MODES)
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")
        check(self.ppo_micro_batch_size_per_gpu is None or self.ppo_micro_batch_size_per_gpu > 0,
              "ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu, "must be > 0 or null")
        positive(self, "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self):
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check(self.horizon > 0, "horizon", self.horizon, "must be > 0")
        check(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0")


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction`: truncated importance weights and rejection sampling for
    off-policy rollouts (plait/algorithms/rollout_correction.py has the math and the metrics).

    w = min(pi_old / pi_rollout, rollout_is_threshold) per token ("token") or per sequence
    ("sequence": the ratio of sequence probabilities), multiplying the policy loss; pi_old is the
    actor's log-prob before the update, pi_rollout the one the rollout sampled with. rollout_rs
    drops tokens or sequences whose divergence passes rollout_rs_threshold from the loss.
    """
    rollout_is: Optional[str] = None          # token | sequence | null: token in one_step_off/fully_async, off in sync
    rollout_is_threshold: Any = 2.0          # the truncation C, or "lower_upper" (IcePop); null only with rollout_is null
    # verl's bypass mode: pi_old is the rollout's log-prob, so the old_log_prob forward is skipped.
    # Exact in sync mode (the rollout samples with the actor's weights); in the async modes PPO's
    # ratio is then taken against the stale rollout policy itself, with no importance weights.
    bypass_mode: bool = False
    rollout_rs: Optional[str] = None          # e.g. token_k1, seq_mean_k3 or "token_k2,seq_max_k3"; null: off
    rollout_rs_threshold: Any = None          # a bound (k1: u means [1/u, u], or "lower_upper"); one per option
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    loss_type: str = "ppo_clip"               # bypass mode's loss: ppo_clip | reinforce

    def __post_init__(self):
        check(self.rollout_is is None or self.rollout_is in IS_LEVELS, "rollout_is", self.rollout_is,
              f"null or one of {', '.join(IS_LEVELS)}")
        one_of(self, "loss_type", BYPASS_LOSS_TYPES)
        t = self.rollout_rs_threshold
        check(not isinstance(t, float) or math.isfinite(t), "rollout_rs_threshold", t, "a finite bound, a string or null")
        if self.rollout_rs is not None:
            try:
                parse_rs(self.rollout_rs, self.rollout_rs_threshold)
            except ValueError as err:
                check(False, "rollout_rs", self.rollout_rs, str(err))
        if self.rollout_is_threshold is not None:
            try:
                parse_is_threshold(self.rollout_is_threshold)
            except ValueError as err:
                check(False, "rollout_is_threshold", self.rollout_is_threshold, str(err))
        check(self.rollout_is_threshold is not None or self.rollout_is is None, "rollout_is_threshold", None,
              f"a number or a 'lower_upper' string with rollout_is={self.rollout_is}")


@dataclass
class FilterGroupsConfig:
    """`algorithm.filter_groups`: DAPO's dynamic sampling. A prompt group whose responses all share one
    value of `metric` carries no signal under group advantages and is dropped; the mode keeps
    generating batches until as many groups as one batch holds have signal, at most
    `max_num_gen_batches` batches per step (0: no limit)."""
    enable: bool = False
    metric: Optional[str] = "reward"          # reward / score / seq_reward: the sequence score; else a key the reward function returns (acc)
    max_num_gen_batches: int = 0
    max_inflight_gen_batches: int = 1         # verl's concurrent generate calls while filling; plait generates one at a time

    def __post_init__(self):
        check(not self.enable or bool(self.metric), "metric", self.metric, "a metric name with enable=true (reward, acc, ...)")
        check(self.max_num_gen_batches >= 0, "max_num_gen_batches", self.max_num_gen_batches, "0 (no limit) or > 0")
        check(self.max_inflight_gen_batches > 0, "max_inflight_gen_batches", self.max_inflight_gen_batches, "must be > 0")




@dataclass
class PfPpoConfig:
    """`algorithm.pf_ppo`: verl's PF-PPO resamples a step's responses with replacement, weighted by their
    score: |s|^weight_pow ("pow"), 1 for the batch's best and worst and 0 otherwise ("max_min"), 0.4 for
    the best and 0.1 otherwise ("max_random")."""
    reweight_method: str = "pow"
    weight_pow: float = 2.0

    def __post_init__(self):
        one_of(self, "reweight_method", ("pow", "max_min", "max_random"))


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gdpo_reward_keys: Optional[list[str]] = None       # gdpo: the reward function's result keys to normalise apart
    gdpo_reward_weights: Optional[list[float]] = None  # gdpo: one weight per key; null: 1 each
    use_pf_ppo: bool = False                  # PF-PPO: resample the batch by score after the advantages (gae)
    pf_ppo: PfPpoConfig = field(default_factory=PfPpoConfig)

    def __post_init__(self):
        one_of(self, "adv_estimator", ESTIMATORS)
        check(not self.use_pf_ppo or self.adv_estimator == "gae", "use_pf_ppo", True,
              f"false with adv_estimator={self.adv_estimator}: verl 0.9.1 resamples by score with gae only (it ignores "
              "use_pf_ppo otherwise); set adv_estimator=gae or drop it")
        check(self.adv_estimator != "gdpo" or bool(self.gdpo_reward_keys), "gdpo_reward_keys", self.gdpo_reward_keys,
              "the reward components' keys with adv_estimator=gdpo (e.g. [format_reward,accuracy_reward])")
        check(self.gdpo_reward_weights is None or len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys or []),
              "gdpo_reward_weights", self.gdpo_reward_weights, "one weight per gdpo_reward_keys entry")
        check(not (self.filter_groups.enable and self.use_kl_in_reward and self.filter_groups.metric == "seq_final_reward"),
              "filter_groups.metric", self.filter_groups.metric, "reward, score, seq_reward or a reward key with "
              "use_kl_in_reward=true: groups are filtered before the in-reward KL is computed")
        check(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        check(0 <= self.lam <= 1, "lam", self.lam, "must be in [0, 1]")
        one_of(self, "kl_penalty", KL_ESTIMATORS)


LOGGERS = ("console", "tensorboard", "wandb", "mlflow", "swanlab", "file", "json_eval",
           "rl_insight")  # verl's, less clearml/trackio/vemlp_wandb
# Loggers accepted and named at start as having no effect, with why.
LOGGER_NO_EFFECT = {"rl_insight": (
    "verl's RL-Insight logger (verl#6680) pushes step metrics, per-role state traces and the engines' own metrics "
    "to an RL-Insight server (RL_INSIGHT_SERVER_URL) for its Grafana dashboards; plait sends nothing there. The "
    "same data is in the run's metrics.jsonl, timeline.jsonl and samples.jsonl, shown by `plait profile report`")}


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayConfig:
    """`trainer.ray`: which Ray to use and what each worker process asks it for (trainer.backend=ray; docs/ray.md)."""

    address: Optional[str] = None                 # a running cluster ("auto", "10.0.0.1:6379"); null: RAY_ADDRESS, else plait starts one
    num_cpus: Optional[int] = None                # logical CPUs of a plait-started instance; null: the machine's count
    object_store_memory_mb: Optional[int] = None  # object store of a plait-started instance; null: Ray's default (30% of RAM)
    num_cpu_workers: int = 1                      # data-parallel trainer processes without GPUs (with GPUs: nnodes x n_gpus_per_node)
    cpus_per_worker: float = 1.0                  # CPU request per worker process; fractions let a small machine host more processes
    placement_timeout_s: float = 60.0             # fail, naming the missing resources, if workers cannot be placed in this time
    placement_strategy: str = "PACK"              # each pool's placement group: PACK (few nodes), SPREAD, STRICT_PACK, STRICT_SPREAD
    # Custom Ray resources each worker of a pool (train, rollout) asks for, e.g. {rollout: {gen_node: 1}}:
    # a pool lands on the nodes started with them (ray start --resources='{"gen_node": 4}').
    pool_resources: dict = field(default_factory=dict)
    # actor -> separated rollout: process_group (a gloo/NCCL broadcast from actor rank 0, not via the
    # driver) or object_store (through the driver, the older path, kept for comparison)
    weight_sync: Literal["process_group", "object_store"] = "process_group"

    def __post_init__(self):
        check(self.address is None or self.address.strip() != "", "address", self.address, "null or a Ray address")
        check(self.num_cpus is None or self.num_cpus > 0, "num_cpus", self.num_cpus, "null or > 0")
        check(self.object_store_memory_mb is None or self.object_store_memory_mb >= 80, "object_store_memory_mb",
              self.object_store_memory_mb, "null or >= 80 (Ray's minimum object store)")
        check(self.num_cpu_workers > 0, "num_cpu_workers", self.num_cpu_workers, "must be > 0")
        check(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "must be > 0 (fractions are fine)")
        check(self.placement_timeout_s > 0, "placement_timeout_s", self.placement_timeout_s, "must be > 0 seconds")
        one_of(self, "placement_strategy", PLACEMENT_STRATEGIES)
        for pool, resources in self.pool_resources.items():
            check(pool in ("train", "rollout", "reward"), f"pool_resources.{pool}", resources,
                  "pools are train, rollout and reward (reward.reward_model.enable_resource_pool)")
            check(isinstance(resources, dict) and all(isinstance(v, (int, float)) and v > 0 for v in resources.values()),
                  f"pool_resources.{pool}", resources, "a mapping of Ray resource name to a positive amount per worker")


@dataclass
class TrainerConfig:
    total_training_steps: Optional[int] = None  # null: total_epochs over the training data
    total_epochs: int = 30
    save_freq: int = -1                       # steps between checkpoints (and at the last step); -1: never
    test_freq: int = -1                       # steps between validations (and at the last step); -1: never
    critic_warmup: int = 0                    # the actor trains from this step on (earlier steps: critic only)
    log_val_generations: int = 0              # validation samples printed and logged per validation
    val_before_train: bool = True
    default_local_dir: Optional[str] = None   # null: outputs/<project_name>/<experiment_name>
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: Optional[str] = None
    resume_allow_config_change: bool = False  # plait's own: resume although a key that changes the run's meaning differs
    max_ckpt_to_keep: Optional[int] = 2
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    logger: list[str] = field(default_factory=lambda: ["console"])
    project_name: str = "plait"
    experiment_name: Optional[str] = None     # null: the mode's name, so demos of different modes don't share outputs
    seed: int = 1
    mode: Literal[tuple(MODES)] = SYNC              # plait/modes.py: one row per mode
    placement: Literal["colocated", "separated"] = "colocated"
    backend: Literal["local", "ray"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int = 1                      # torch threads in the driver; 0: torch's default (1 is steadier on shared CPUs)
    nnodes: int = 1
    n_gpus_per_node: int = 8
    ray: RayConfig = field(default_factory=RayConfig)  # trainer.backend=ray only; docs/ray.md
    check_weight_sync: bool = True            # plait's own: after each weight sync, the engine's log-probs of a probe vs the actor's
    max_restarts: int = 0                     # plait's own (AReaL's recover.retries): resumes after a crash that is not the user's
    use_v1: bool = True                       # verl 0.9.1's default trainer: trainer.v1.trainer_mode picks the mode
    v1: V1Config = field(default_factory=V1Config)
    checkpoint_callback_class: Optional[str] = None  # module.Class with on_save(trainer, global_step, checkpoint_dir, async_save)
    val_only: bool = False                    # validate (val_before_train) and stop, as verl does

    def __post_init__(self):
        check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0 (0: off)")
        check(self.total_training_steps is None or self.total_training_steps > 0, "total_training_steps",
              self.total_training_steps, "must be > 0 or null")
        check(self.total_epochs > 0, "total_epochs", self.total_epochs, "must be > 0")
        check(self.save_freq == -1 or self.save_freq > 0, "save_freq", self.save_freq, "-1 or a positive number of steps")
        check(self.test_freq == -1 or self.test_freq > 0, "test_freq", self.test_freq, "-1 or a positive number of steps")
        check(self.max_ckpt_to_keep is None or self.max_ckpt_to_keep > 0, "max_ckpt_to_keep", self.max_ckpt_to_keep, "must be > 0 or null")
        for i, name in enumerate(self.logger):
            check(name in LOGGERS, f"logger[{i}]", name, f"one of {', '.join(LOGGERS)}")
        check(self.resume_mode != "resume_path" or bool(self.resume_from_path), "resume_from_path",
              self.resume_from_path, "a global_step_N checkpoint directory when resume_mode=resume_path")
        check(self.num_threads >= 0, "num_threads", self.num_threads, "must be >= 0")
        for name in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
            check(getattr(self, name) is None or getattr(self, name) > 0, name, getattr(self, name), "must be > 0 or null")
        check(self.resume_from_path is None or self.resume_mode != "disable", "resume_from_path", self.resume_from_path,
              "is not read with resume_mode=disable; set auto or resume_path, or drop the path")
        if self.resume_from_path and self.resume_mode == "auto":  # verl 0.9.1: auto resumes from a path given
            self.resume_mode = "resume_path"
        for name in ("project_name", "experiment_name"):  # each is one folder of outputs/<project>/<experiment>
            value = getattr(self, name)
            check(value is None or (value not in ("", ".", "..") and "/" not in value and "\0" not in value
                                    and os.sep not in value), name, value, "a folder name: not empty, '.' or '..', no '/'")
        positive(self, "nnodes", "n_gpus_per_node")


@dataclass
class AsyncTrainingConfig:
    """`async_training`: the fully_async mode's knobs, with verl's names (docs/modes.md).

    A step (one policy version) is `trigger_parameter_sync_step` local updates of
    `require_batches` x `ppo_mini_batch_size` prompts each, then a weight sync. The rollouter
    pauses while queued plus in-flight prompts counted since the last sync would pass
    ppo_mini_batch_size x require_batches x (staleness_threshold + 1) x trigger_parameter_sync_step.
    """
    staleness_threshold: float = 0.0          # how far past one sync period the rollouter may run ahead
    trigger_parameter_sync_step: int = 1      # local updates per weight sync (per step)
    require_batches: int = 1                  # ppo mini-batches per local update
    partial_rollout: bool = True              # a sync aborts generation; it resumes from the tokens so far
    gen_batch_size: Optional[int] = None      # prompts per rollouter generate call; null: ppo_mini_batch_size

    def __post_init__(self):
        check(self.staleness_threshold >= 0, "staleness_threshold", self.staleness_threshold, "must be >= 0")
        check(self.trigger_parameter_sync_step > 0, "trigger_parameter_sync_step", self.trigger_parameter_sync_step,
              "must be > 0")
        check(self.require_batches > 0, "require_batches", self.require_batches, "must be > 0")
        check(self.gen_batch_size is None or self.gen_batch_size > 0, "gen_batch_size", self.gen_batch_size,
              "must be > 0 or null")


@dataclass
class PlaitConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def __post_init__(self):
        """The rules across nodes. Over 60 lines: one check after another, each on its own, read top to bottom."""
        actor = self.actor_rollout_ref.actor
        if self.data.train_batch_size == 0:  # verl's fully-async scripts: a trainer batch is one local update's prompts
            check(MODES[self.trainer.mode].streams, "data.train_batch_size", 0,
                  "> 0 (0 only with trainer.mode=fully_async: the trainer's batch is then ppo_mini_batch_size x "
                  "async_training.require_batches)")
            self.data.train_batch_size = actor.ppo_mini_batch_size * self.async_training.require_batches
        self._inherit()
        if self.warmstart.steps:
            from plait.agents.warmstart import TRANSCRIPT_TASKS
            check(self.data.task in TRANSCRIPT_TASKS and self.data.train_files is None, "warmstart.steps", self.warmstart.steps,
                  f"0 here: the warm start trains on generated tool transcripts, which only the built-in task(s) "
                  f"{', '.join(TRANSCRIPT_TASKS)} have (data.task={self.data.task}, data.train_files={self.data.train_files})")
        # Diffusion mode has no critic and updates on the whole batch with diffusion.actor's settings.
        lm = MODES[self.trainer.mode].lm
        check(not lm or self.data.train_batch_size % actor.ppo_mini_batch_size == 0, "actor_rollout_ref.actor.ppo_mini_batch_size",
              actor.ppo_mini_batch_size, f"must divide data.train_batch_size={self.data.train_batch_size}")
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.adv_estimator == "gae"
        check(self.algorithm.adv_estimator != "gae" or self.critic.enable, "critic.enable", self.critic.enable,
              "must be true with algorithm.adv_estimator=gae (GAE needs values)")
        if self.critic.enable and lm:
            check(self.data.train_batch_size % self.critic.ppo_mini_batch_size == 0, "critic.ppo_mini_batch_size",
                  self.critic.ppo_mini_batch_size, f"must divide data.train_batch_size={self.data.train_batch_size}")
        # grpo/rloo with rollout.n=1 run as in verl: a group of one has no baseline (algorithms/advantages.py).
        mode = self.trainer.mode
        check(MODES[mode].placement in (None, self.trainer.placement) or MODES[mode].v1, "trainer.placement",
              self.trainer.placement, f"must be separated with trainer.mode={mode}: the rollout generates "
              "on its own workers while the actor trains")
        check(self.actor_rollout_ref.rollout.nnodes == 0 or self.trainer.placement == "separated",
              "actor_rollout_ref.rollout.nnodes", self.actor_rollout_ref.rollout.nnodes,
              "0 with trainer.placement=colocated (the rollout shares the actor's rank 0); a rollout pool of its own "
              "needs trainer.placement=separated")
        check(not self.reward.reward_model.enable_resource_pool or self.reward.reward_model.enable,
              "reward.reward_model.enable_resource_pool", True, "needs reward.reward_model.enable=true (the pool hosts it)")
        self._check_discrete_profiling(mode)
        check(self.algorithm.adv_estimator != "grpo_passk" or self.actor_rollout_ref.rollout.n >= 2,
              "actor_rollout_ref.rollout.n", self.actor_rollout_ref.rollout.n,
              ">= 2 with algorithm.adv_estimator=grpo_passk (best minus second best of each prompt's responses)")
        check(lm or not self.algorithm.filter_groups.enable, "algorithm.filter_groups.enable", True,
              "false with trainer.mode=diffusion (DAPO's dynamic sampling runs in the language-model modes)")
        self._resolve_correction(mode)
        self._resolve_engine()
        self._check_v1(mode)
        if MODES[mode].streams:
            a = self.async_training
            required = actor.ppo_mini_batch_size * a.require_batches
            a.gen_batch_size = a.gen_batch_size or actor.ppo_mini_batch_size
            check(required % a.gen_batch_size == 0, "async_training.gen_batch_size", a.gen_batch_size,
                  f"must divide ppo_mini_batch_size x require_batches = {required} (a local update takes whole "
                  "generate calls)")

    def _check_v1(self, mode: str) -> None:
        """verl 0.9.1's rules of its V1 async modes: separate_async trains one PPO mini-batch per local update
        (train_batch_size = parameter_sync_step x ppo_mini_batch_size) on a rollout of its own."""
        if mode not in V1_MODES:
            return
        mini, batch = self.actor_rollout_ref.actor.ppo_mini_batch_size, self.data.train_batch_size
        check(not self.algorithm.filter_groups.enable, "algorithm.filter_groups.enable", True,
              f"false with trainer.v1.trainer_mode={mode}: verl's V1 sampler evicts the groups DAPO's filter drops and "
              "issues fresh prompts for them, which plait's V1 modes do not do yet (trainer.v1.trainer_mode=sync filters)")
        if mode == SEPARATE_ASYNC:
            sync_step = self.trainer.v1.separate_async.parameter_sync_step
            check(batch == sync_step * mini, "trainer.v1.separate_async.parameter_sync_step", sync_step,
                  f"data.train_batch_size / actor.ppo_mini_batch_size = {batch} / {mini}"
                  + (f" = {batch // mini}" if batch % mini == 0 else " (a whole number)")
                  + " (verl's separate_async trains one PPO mini-batch per local update)")
            check(self.trainer.placement == "separated", "trainer.placement", self.trainer.placement,
                  "separated with trainer.v1.trainer_mode=separate_async (its rollout generates on workers of its own)")

    def _check_discrete_profiling(self, mode: str) -> None:
        """Per-stage torch traces (tool_config.torch.discrete) of an async mode on the local backend are refused:
        the rollout generates in a thread of the driver there, and torch.profiler runs one collection per
        process, so traces of concurrent stages cannot be taken."""
        if not MODES[mode].rollout_thread or self.trainer.backend != "local" or self.global_profiler.tool != "torch":
            return
        roles = {"actor_rollout_ref.actor": self.actor_rollout_ref.actor, "actor_rollout_ref.rollout":
                 self.actor_rollout_ref.rollout, "actor_rollout_ref.ref": self.actor_rollout_ref.ref,
                 "critic": self.critic}
        for key, node in roles.items():
            check(not (node.profiler.enable and node.profiler.tool_config.torch.discrete),
                  f"{key}.profiler.tool_config.torch.discrete", True,
                  f"false with trainer.mode={mode} on the local backend (its rollout thread's stages overlap "
                  "the trainer's, and torch profiles one collection per process); use trainer.backend=ray")

    def _resolve_correction(self, mode: str) -> None:
        """verl's bypass-mode loss name, and token-level rollout correction by default in the async modes."""
        actor, correction = self.actor_rollout_ref.actor, self.algorithm.rollout_correction
        if actor.policy_loss.loss_mode == "bypass_mode":  # verl's name for the loss its bypass mode selects
            actor.policy_loss.loss_mode, correction.bypass_mode = "vanilla", True
        # bypass mode takes rollout_is too, as verl does: the actor weighs pi_current / pi_rollout with
        # loss_type=reinforce; with ppo_clip the clipped ratio is the correction and the weights are only reported
        check(not (correction.bypass_mode and self.algorithm.adv_estimator.endswith("optimal_token_baseline")),
              "algorithm.adv_estimator", self.algorithm.adv_estimator, "not with bypass mode: the estimator needs the "
              "old log-prob pass's sum of squared probabilities, which bypass mode skips (verl fails there too)")
        if correction.rollout_is is None and mode in ASYNC_MODES and not correction.bypass_mode:
            correction.rollout_is = "token"
            correction.rollout_is_threshold = correction.rollout_is_threshold or 2.0  # verl's default C

    def _resolve_engine(self) -> None:
        """rollout.name unset: the engine table's default (workers/engine.py); the rollout's dtype follows
        the model's; an engine holding several devices needs that many CUDA devices; the distillation
        teachers' inference blocks follow the rollout's (`_resolve_teachers`)."""
        r = self.actor_rollout_ref.rollout
        if r.name is None:
            r.name = default_engine(self.actor_rollout_ref.model.path)
        r.dtype = r.dtype or self.actor_rollout_ref.model.dtype
        check_kept_set(r, self.trainer.mode, r.agent_loops)
        judge = self.reward.reward_model.rollout
        if judge.name is None:
            judge.name = default_engine(self.reward.reward_model.model_path)
        check(judge.name in ENGINES, "reward.reward_model.rollout.name", judge.name, f"one of {', '.join(ENGINES)}")
        if ENGINES[r.name].devices(r) > 1:  # an engine that does not read the key names it as having no effect
            check(torch_cuda_count() >= r.tensor_model_parallel_size and self.trainer.device != "cpu",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size", r.tensor_model_parallel_size,
                  f"1 here: tensor parallelism needs {r.tensor_model_parallel_size} CUDA devices and this machine "
                  f"has {torch_cuda_count()}")
        self._resolve_teachers()

    def _resolve_teachers(self) -> None:
        """The distillation teachers' inference keys that verl fills from the student's rollout, then verl's length
        check."""
        d, r = self.distillation, self.actor_rollout_ref.rollout
        check(MODES[self.trainer.mode].lm or not d.enabled, "distillation.enabled", True,
              "false with trainer.mode=diffusion (on-policy distillation trains language models)")
        for t in d.teacher_models.values():
            i = t.inference
            i.name, i.dtype = i.name or r.name, i.dtype or r.dtype
            i.temperature = r.temperature if i.temperature is None else i.temperature
            i.prompt_length = i.prompt_length or self.data.max_prompt_length
            i.response_length = i.response_length or self.data.max_response_length
        check_lengths(d, self.data.max_prompt_length, self.data.max_response_length)

    def _inherit(self) -> None:
        """verl's null keys: a micro-batch takes the whole (mini-)batch, a token length or seed the key it follows."""
        arr, critic = self.actor_rollout_ref, self.critic
        actor, n = arr.actor, arr.rollout.n
        self.data.seed = self.trainer.seed if self.data.seed is None else self.data.seed
        arr.ref.strategy = arr.ref.strategy or actor.strategy
        # profiler artifacts belong to their run (verl: one shared outputs/profile, which runs overwrote)
        self.global_profiler.save_path = self.global_profiler.save_path or os.path.join(self.output_dir, "profile")
        actor.ppo_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu or actor.ppo_mini_batch_size * n
        critic.ppo_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu or critic.ppo_mini_batch_size * n
        # seq-mean-token-sum-norm's constant: verl divides by the padded length, which is max_response_length there
        actor.loss_scale_factor = actor.loss_scale_factor or self.data.max_response_length
        critic.loss_scale_factor = critic.loss_scale_factor or self.data.max_response_length
        for node in (arr.rollout, arr.ref):
            node.log_prob_micro_batch_size_per_gpu = node.log_prob_micro_batch_size_per_gpu or self.data.train_batch_size * n
            node.log_prob_use_dynamic_bsz = (actor.use_dynamic_bsz if node.log_prob_use_dynamic_bsz is None
                                             else node.log_prob_use_dynamic_bsz)
            node.log_prob_max_token_len_per_gpu = node.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu
        for key, node in (("actor_rollout_ref.actor", actor), ("critic", critic)):
            check(node.ppo_micro_batch_size_per_gpu > 0, f"{key}.ppo_micro_batch_size_per_gpu",
                  node.ppo_micro_batch_size_per_gpu, "must be > 0 or null")

    @property
    def output_dir(self) -> str:
        t = self.trainer
        return t.default_local_dir or f"outputs/{t.project_name}/{t.experiment_name or t.mode}"

    @property
    def uses_ref(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def total_steps(self, batches_per_epoch: int) -> int:
        """verl's rule, for every mode: trainer.total_training_steps when set, else total_epochs x
        batches per epoch."""
        t = self.trainer
        return t.total_training_steps or t.total_epochs * batches_per_epoch


DEMO_PRESET = os.path.join(os.path.dirname(__file__), "configs", "demo.yaml")


def parse_value(raw: str) -> Any:
    """A command-line value as verl's Hydra reads it: YAML (numbers, bools, lists with or without
    quotes), `null`/`None`/`~` for null, anything else a bare string."""
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw
    if value == "None":
        return None
    if isinstance(value, str) and "_" not in value:  # YAML 1.1 reads 3e-4 as a string; '0.5_2' (IcePop) stays one
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_override(tree: dict, text: str) -> None:
    """Apply one override to `tree`: `key=value` and `+key=value` set, `~key` drops a key set earlier."""
    if text.startswith("~"):
        keys = text[1:].split("=", 1)[0].strip().split(".")
        node = tree
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(keys[-1], None)
        return
    if "=" not in text:
        raise ConfigError(text, None, "overrides are key=value, +key=value or ~key, e.g. trainer.total_training_steps=10")
    key, raw = text.lstrip("+").split("=", 1)
    keys, node = key.strip().split("."), tree
    for i, part in enumerate(keys[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(".".join(keys[: i + 1]), node, "is a value, not a section")
    node[keys[-1]] = parse_value(raw)


def take_no_effect(tree: dict, prefix: str = "") -> list[str]:
    """Remove from `tree` the verl keys that have no effect in plait (config_verl.NO_EFFECT); return them."""
    taken = []
    for key in list(tree):
        path = f"{prefix}{key}"
        value = tree[key]
        if any(p in NO_EFFECT for p in _prefixes(path)):
            taken += [k for k, _ in _leaf_items(value, f"{path}.")] if isinstance(value, dict) and value else [path]
            del tree[key]
        elif isinstance(value, dict) and value:
            taken += take_no_effect(value, f"{path}.")
            if not value:  # a verl-only section, now empty
                del tree[key]
    return taken


def _leaf_items(tree: dict, prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a nested dict."""
    out = []
    for key, value in tree.items():
        out += _leaf_items(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [(f"{prefix}{key}", value)]
    return out


def no_effect_notice(keys: list[str], cluster: dict[str, str] = LOCAL_BACKEND_NO_EFFECT) -> str:
    """The one warning block naming the no-effect keys a user set, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for key in keys:
        engines = engine_no_effect()
        reason = cluster.get(key) or next(engines.get(p) or NO_EFFECT[p] for p in _prefixes(key)
                                          if p in engines or p in NO_EFFECT)
        by_reason.setdefault(reason, []).append(key)
    lines = ["plait: these verl keys are accepted but have no effect here:"]
    for reason, group in by_reason.items():
        lines += [f"  - {reason}:", *(f"      {key}" for key in group)]
    return "\n".join(lines)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def load_config(path: str | None = None, overrides: list[str] = (), search: list[str] = ()) -> PlaitConfig:
    """Defaults <- demo preset <- YAML file <- overrides, built and validated as one tree (`parse_config`),
    then the start notices said (`start_notices`)."""
    cfg, user, no_effect, moved, machine = parse_config(path, overrides, search)
    for line in start_notices(cfg, user, no_effect, moved, machine):
        print(line, file=sys.stderr)
    return cfg


def parse_config(path: str | None = None, overrides: list[str] = (),
                 search: list[str] = ()) -> tuple[PlaitConfig, dict, list[str], list[str]]:
    """The config, the leaf keys the user set (key -> value), the verl keys set that have no effect
    here, and the verl 0.8 reward keys moved ("old -> new").

    The demo preset (configs/demo.yaml) applies when actor_rollout_ref.model.path is null.
    Every error of the file and command line is raised at once (a ConfigErrors for several). A
    verl YAML's `defaults:` list is composed (files found beside it or in `search`), `hydra:` and
    `_target_` dropped and `${...}` resolved (config_verl.compose_yaml).
    """
    tree, errors = read_config_file(path, search), []
    for text in overrides:
        try:
            apply_override(tree, text)
        except ConfigError as err:
            errors.append(err)
    defaults = to_dict(PlaitConfig())
    try:
        tree = resolve_interpolations(tree, defaults)
    except ConfigError as err:
        raise_all([*errors, err])
    moved = map_legacy_reward(tree)
    drop_empty(tree)
    machine = [*empty_booleans(tree, defaults), *machine_notes(tree)]
    try:
        map_recipe_rollout_pool(tree)
    except ConfigError as err:
        errors.append(err)
    user = dict(_leaf_items(tree, ""))
    refused = refusal(user)
    if refused:
        raise ConfigError(*refused)
    mode, async_set = user.get("trainer.mode", SYNC), _changed(user, "async_training", AsyncTrainingConfig())
    if async_set and mode not in ASYNC_MODES:
        errors.append(ConfigError("trainer.mode", mode, f"one of {', '.join(ASYNC_MODES)} when async_training.* is "
                                  f"set ({', '.join(async_set)})"))
    machine += map_v1_mode(tree, user, errors)
    no_effect = take_no_effect(tree)
    _inherit_from_actor(tree)
    if user.get("actor_rollout_ref.model.path") is None:
        tree = merge(_read_yaml(DEMO_PRESET, "preset"), tree)
    cfg = None
    try:
        cfg = build(PlaitConfig, tree)
    except ConfigError as err:
        found = err.errors if isinstance(err, ConfigErrors) else [err]
        hidden, cfg = build_without(PlaitConfig, tree, found)
        errors += [*found, *hidden]
    if errors:
        first = errors[0] if len(errors) == 1 else ConfigErrors(errors)
        first.partial = cfg
        raise first
    return cfg, user, no_effect, moved, machine


JUDGE_VLLM_ONLY = {
    f"reward.reward_model.rollout.{key}": "vLLM engine settings of the judge: its engine is hf "
                                          "(reward.reward_model.rollout.name=vllm reads them)"
    for key in ("gpu_memory_utilization", "max_num_batched_tokens", "enforce_eager", "enable_chunked_prefill",
                "enable_prefix_caching", "load_format")}


def start_notices(cfg: PlaitConfig, user: dict, no_effect: list[str], moved: list[str],
                  machine: list[str]) -> list[str]:
    """The lines said at start, in order: the demo preset applies; which engine an unset rollout.name
    chose; the engine's own notes; the keys set that have no effect here (taken from the tree, this
    backend's and device's, the engine's); the machine notices (an NPU device, empty booleans); the verl 0.8
    reward keys moved."""
    demo = user.get("actor_rollout_ref.model.path") is None
    lines = []
    if demo:
        lines.append("plait: actor_rollout_ref.model.path is null: the demo preset "
                     "(plait/configs/demo.yaml) applies under your settings")
    if not demo and user.get("actor_rollout_ref.rollout.name") is None and MODES[cfg.trainer.mode].lm:
        lines.append(unset_note(cfg.actor_rollout_ref.rollout.name))
    engine = ENGINES[cfg.actor_rollout_ref.rollout.name]
    lines += engine.notes(cfg)
    cluster = {}  # the process-count keys this backend and device do not read
    offload_set = any(key in CPU_NO_EFFECT for key in user)
    on_cpu = (cfg.trainer.backend == "ray" or offload_set) and (  # torch only where the answer matters
        cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not _cuda_available()))
    if cfg.trainer.backend == "local":
        cluster = LOCAL_BACKEND_NO_EFFECT
    elif on_cpu:
        cluster = CPU_RAY_NO_EFFECT
    if on_cpu and offload_set:
        cluster = {**cluster, **CPU_NO_EFFECT}
    if cfg.trainer.mode not in V1_MODES:
        cluster = {**cluster, "data.gen_batch_size": "prompts per generate call of verl's V1 async modes "
                   "(trainer.v1.trainer_mode); plait's other modes generate each step's batch whole (the fully-async "
                   "recipe's chunk is async_training.gen_batch_size)"}
        v1 = _changed(user, "trainer.v1", V1Config())
        cluster.update({key: "read by verl's V1 async modes only (trainer.v1.trainer_mode colocate_async or "
                        "separate_async); verl's sync trainer does not read them either" for key in v1
                        if key not in ("trainer.v1.trainer_mode", "trainer.v1.sampler.sync_refill_failed_groups")})
        if "trainer.v1.sampler.sync_refill_failed_groups" in v1:
            cluster["trainer.v1.sampler.sync_refill_failed_groups"] = (
                "verl's sync sampler replaces failed groups instead of padding them: plait's sync mode generates a "
                "step's batch in one call and stops the run with one line when it fails, so no failed group is trained")
    no_effect = no_effect + [key for key in user if key in cluster]
    inert = {key: why for key, (default, why) in FIELD_NO_EFFECT.items() if user.get(key, default) != default}
    no_effect, cluster = no_effect + list(inert), {**cluster, **inert}
    teacher_inert = distillation_no_effect(cfg.distillation, user, cfg.trainer.backend)
    no_effect, cluster = no_effect + list(teacher_inert), {**cluster, **teacher_inert}
    no_effect += [key for key in user if any(p in engine.no_effect for p in _prefixes(key))]
    judge_engine = ENGINES.get(cfg.reward.reward_model.rollout.name)  # the judge's settings its engine does not read
    judge_inert = {key: why for key, why in JUDGE_VLLM_ONLY.items() if judge_engine is not None
                   and "actor_rollout_ref.rollout." + key.rsplit(".", 1)[1] in judge_engine.no_effect}
    no_effect, cluster = no_effect + [key for key in user if key in judge_inert], {**cluster, **judge_inert}
    if no_effect:
        lines.append(no_effect_notice(no_effect, cluster))
    lines += distillation_notes(cfg.distillation)
    lines += [f"plait: trainer.logger={name} has no effect: {why}" for name, why in LOGGER_NO_EFFECT.items()
              if name in cfg.trainer.logger]
    lines += machine
    if moved:
        lines.append("plait: verl 0.8 reward keys mapped onto verl 0.9's reward tree: " + ", ".join(moved))
    return lines


def map_v1_mode(tree: dict, user: dict, errors: list) -> list[str]:
    """verl 0.9.1's `trainer.v1.trainer_mode` (its V1 trainer, `trainer.use_v1`, is the default) picks plait's mode
    of that name, in place: separate_async on a rollout of its own (placement=separated) unless set otherwise.
    A contradicting trainer.mode goes to `errors`; returns the start line for a V1 mode set with use_v1=false."""
    v1 = user.get("trainer.v1.trainer_mode", SYNC)
    if v1 == SYNC:
        return []
    if user.get("trainer.use_v1", True) is False:
        return [f"plait: trainer.v1.trainer_mode={v1} has no effect with trainer.use_v1=false: verl's legacy trainer "
                "does not read trainer.v1, and plait trains in trainer.mode (sync unless set)"]
    mode = user.get("trainer.mode")
    if mode not in (None, v1):
        errors.append(ConfigError("trainer.mode", mode, f"{v1} or unset with trainer.v1.trainer_mode={v1} (the mode "
                                  "verl's V1 trainer runs)"))
        return []
    _set(tree, "trainer.mode", v1)
    if v1 == SEPARATE_ASYNC and "trainer.placement" not in user:
        _set(tree, "trainer.placement", "separated")
    return []


def empty_booleans(tree: dict, defaults: dict) -> list[str]:
    """'' on a boolean key (`key=$VAR` with VAR unset): verl reads its booleans by truthiness, so it
    runs them false; so does plait, in place, and names them in one line."""
    named = []
    for key, value in _leaf_items(tree, ""):
        if value == "" and isinstance(_lookup(defaults, key), bool):
            _set(tree, key, False)
            named.append(key)
    if not named:
        return []
    return [f"plait: {', '.join(named)} {'is' if len(named) == 1 else 'are'} empty (as an unset shell variable "
            f"gives): read as false, as verl reads {'it' if len(named) == 1 else 'them'}"]


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def map_legacy_reward(tree: dict) -> list[str]:
    """Move verl 0.8's top-level reward keys (config_verl.LEGACY_REWARD) onto the `reward.*` tree,
    in place, as verl 0.9 does: a legacy key set to null means unset and is dropped. Returns
    "old -> new" for each key moved."""
    moved = []
    for section in ("custom_reward_function", "reward_model", "sandbox_fusion"):
        node = tree.pop(section, None)
        if not isinstance(node, dict):
            if node is not None:
                tree[section] = node  # reported by the tree builder
            continue
        kept: dict = {}
        for key, value in _leaf_items(node, f"{section}."):
            prefix = next((p for p in _prefixes(key) if p in LEGACY_REWARD), None)
            if prefix is None:
                _set(kept, key, value)
            elif value is not None:
                new = LEGACY_REWARD[prefix] + key[len(prefix):]
                _set(tree, new, value)
                moved.append(f"{key} -> {new}")
        tree.update(kept)
    return moved


def map_recipe_rollout_pool(tree: dict) -> None:
    """The async recipes' top-level rollout.{nnodes,n_gpus_per_node} onto actor_rollout_ref.rollout (one pool)."""
    top = tree.get("rollout")
    if not isinstance(top, dict):
        return
    given = {old: top.pop(old.split(".")[-1]) for old in RECIPE_ROLLOUT_POOL if old.split(".")[-1] in top}
    if not top:
        del tree["rollout"]
    for old, value in given.items():
        new, name = RECIPE_ROLLOUT_POOL[old], old.split(".")[-1]
        rollout = (tree.get("actor_rollout_ref") or {}).get("rollout") or {}
        if isinstance(rollout, dict) and rollout.get(name, value) != value:
            raise ConfigError(old, value, f"differs from {new}={rollout[name]!r}: both name the rollout's pool; set one")
        _set(tree, new, value)


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[last] = value


# Critic keys that default to the actor's value, as verl's ${oc.select:actor_rollout_ref.actor...} does.
CRITIC_FROM_ACTOR = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "loss_scale_factor")


def _inherit_from_actor(tree: dict) -> None:
    """Give the critic the actor's CRITIC_FROM_ACTOR values that the user set for the actor only."""
    actor, critic = (tree.get("actor_rollout_ref") or {}).get("actor") or {}, tree.get("critic") or {}
    if not (isinstance(actor, dict) and isinstance(critic, dict)):
        return  # reported by the tree builder
    inherited = {key: actor[key] for key in CRITIC_FROM_ACTOR if key in actor and key not in critic}
    if inherited:
        tree["critic"] = {**critic, **inherited}


def _changed(user: dict[str, Any], section: str, node: Any) -> list[str]:
    """The keys under `section` that the user set to something other than `node`'s defaults."""
    defaults, unset = dict(_leaf_items(to_dict(node), f"{section}.")), object()
    return [key for key, value in user.items() if key.startswith(f"{section}.") and defaults.get(key, unset) != value]


def read_config_file(path: str | None, search: list[str] = ()) -> dict:
    """A YAML config file as a plain tree, its defaults list composed (load_config resolves `${...}`
    once the overrides are in, as Hydra does)."""
    if not path:
        return {}
    return compose_yaml(_read_yaml(path, "--config"), path, [os.path.dirname(path) or ".", *search],
                        lambda p: _read_yaml(p, "defaults"))


def _read_yaml(path: str | None, what: str) -> dict:
    if not path:
        return {}
    try:
        with open(path) as f:
            tree = load_yaml(f) or {}
    except FileNotFoundError:
        raise ConfigError(what, path, "no such file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(what, path, f"not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(tree, dict):
        raise ConfigError(what, path, "the YAML file must hold a mapping at the top level")
    return tree

