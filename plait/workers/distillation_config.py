"""`distillation`: verl 0.9.1's on-policy distillation keys (its distillation.yaml), checked as verl checks them.

plait.config reads these nodes to build and check the tree, so they import no torch. The teacher role
(plait/workers/teacher.py) and the loss (plait/algorithms/distillation.py) read them.

What differs from verl, by design: a teacher is not served by a rollout engine here. Each teacher
worker holds every teacher as a transformers model and scores the student's tokens with one forward
pass (the ref role's code path), so the engine's tuning keys (`inference.gpu_memory_utilization`, ...)
have no effect and are named at start (`no_effect`); `inference.max_num_batched_tokens` bounds the tokens of
one teacher forward, `inference.dtype` is its compute dtype, `inference.max_model_len` is checked as verl
checks it. `distillation.nnodes=0` (verl's default, which verl refuses with distillation on) runs the
teachers beside the actor on its workers; `nnodes > 0` gives them a pool of their own on Ray
(`nnodes x n_gpus_per_node` workers; CPU: worker processes), whose size verl's rule checks against the
teachers' `num_replicas x tensor x data x pipeline parallel` sizes. plait's own key: `profiler`, the
teacher role's profiler node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from plait.algorithms.names import DISTILLATION_ESTIMATOR_MODES, DISTILLATION_TOPK_MODES
from plait.configtree import ConfigError, check
from plait.profiler.config import RoleProfilerConfig

DEFAULT_TEACHER = "teacher_model"  # verl's default entry: the single teacher, popped when others are named
LOSS_MODES = DISTILLATION_TOPK_MODES + DISTILLATION_ESTIMATOR_MODES
# inference.* keys of verl's serving engine that mean nothing to a forward pass over given tokens
ENGINE_KEYS = ("name", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
               "expert_parallel_size", "max_num_seqs", "load_format", "engine_kwargs", "limit_images",
               "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init")
PARALLEL_KEYS = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")


@dataclass
class DistillationLossConfig:
    """`distillation.distillation_loss` (plait/algorithms/distillation.py), verl's YAML defaults."""
    loss_mode: str = "k3"
    topk: Optional[int] = 32                  # the teacher's top-k with loss_mode=forward_kl_topk
    use_task_rewards: bool = True             # the actor's policy loss stays beside the distillation loss
    distillation_loss_coef: float = 1.0       # its weight there (with use_task_rewards only)
    loss_max_clamp: Optional[float] = None    # per-token losses clamped to +-this
    log_prob_min_clamp: Optional[float] = None  # top-k log-probs floored at this
    use_policy_gradient: bool = False         # -loss as the advantage of PPO's vanilla clipped loss (use k1)
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2     # null: clip_ratio
    clip_ratio_high: Optional[float] = 0.2
    # verl's dataclass has these two beyond its YAML: plait's student forward always gathers the top-k
    # log-probs chunk by chunk (plait/workers/logprobs.py), so both only say how verl would have done it
    use_chunked_topk: bool = False
    chunked_topk_chunk_size: int = 4096

    def __post_init__(self):
        check(self.loss_mode in LOSS_MODES, "loss_mode", self.loss_mode, f"one of {', '.join(LOSS_MODES)}")
        check(self.policy_loss_mode == "vanilla", "policy_loss_mode", self.policy_loss_mode,
              "vanilla: verl 0.9.1 implements only PPO's vanilla clipped loss for use_policy_gradient")
        check(self.use_policy_gradient or self.loss_mode != "k1", "loss_mode", self.loss_mode,
              "not k1 with use_policy_gradient=false: k1's gradient does not depend on the teacher's log-probs "
              "(use k3 or forward_kl_topk, or set use_policy_gradient=true)")
        check(self.loss_mode not in DISTILLATION_TOPK_MODES or (self.topk is not None and self.topk >= 1), "topk",
              self.topk, f"an integer >= 1 with loss_mode={self.loss_mode} (the teacher's top-k)")
        check(self.loss_max_clamp is None or self.loss_max_clamp > 0, "loss_max_clamp", self.loss_max_clamp,
              "a number > 0 (losses are clamped to [-it, it]) or null")
        check(self.chunked_topk_chunk_size >= 1, "chunked_topk_chunk_size", self.chunked_topk_chunk_size, "an integer >= 1")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass
class TeacherInferenceConfig:
    """`distillation.teacher_models.<name>.inference`: the keys verl's distillation.yaml sets of its RolloutConfig.
    null: the student's (verl's ${oc.select:actor_rollout_ref.rollout.*}), filled in by plait.config."""
    name: Optional[str] = None
    dtype: Optional[str] = None               # the teacher forward's compute dtype
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: Optional[list] = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192        # tokens of one teacher forward (a longer row gets one of its own)
    max_model_len: Optional[int] = None       # prompt + response + 1 must fit (verl's check)
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)
    limit_images: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = True
    prompt_length: Optional[int] = None
    response_length: Optional[int] = None
    temperature: Optional[float] = None       # verl scores at 1.0 whatever this says (and warns)

    def __post_init__(self):
        check(self.dtype is None or self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
              "one of auto, float32, bfloat16, float16 or null (the student rollout's)")
        for key in (*PARALLEL_KEYS, "expert_parallel_size", "max_num_batched_tokens", "max_num_seqs"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "an integer >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len,
              "an integer >= 1 or null")

    @property
    def per_replica_world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


@dataclass
class TeacherModelConfig:
    """`distillation.teacher_models.<name>`: one teacher, the rows whose routing value is `key`."""
    key: Optional[str] = None                 # the routing value (distillation.teacher_key's column); one teacher: any
    model_path: Optional[str] = None          # a local Hugging Face causal LM sharing the student's tokenizer
    num_replicas: int = 0                     # one teacher: the pool's size / per-replica size (verl's rule)
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)

    def __post_init__(self):
        check(self.num_replicas >= 0, "num_replicas", self.num_replicas, "an integer >= 0")


@dataclass
class DistillationConfig:
    """`distillation`: on-policy distillation from one teacher or several routed by a data column."""
    enabled: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0                           # 0: the teachers live on the actor's workers (plait's colocation)
    teacher_models: dict[str, TeacherModelConfig] = field(default_factory=lambda: {DEFAULT_TEACHER: TeacherModelConfig()})
    teacher_key: str = "data_source"          # the row column whose value picks a teacher
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)  # plait's: the teacher role's

    def __post_init__(self):
        check(self.nnodes >= 0, "nnodes", self.nnodes, "an integer >= 0 (0: the teachers on the actor's workers)")
        check(self.n_gpus_per_node >= 1 or self.nnodes == 0, "n_gpus_per_node", self.n_gpus_per_node,
              "an integer >= 1 with nnodes > 0 (the teacher pool's devices per node; CPU: worker processes)")
        if self.enabled:
            self.teachers()  # verl's checks of the teacher entries, each a ConfigError

    @property
    def pool_size(self) -> int:
        """Workers of the teachers' own pool; 0: they share the actor's."""
        return self.nnodes * self.n_gpus_per_node

    def teachers(self) -> dict[str, TeacherModelConfig]:
        """The teachers by routing key, as verl resolves them: the default entry alone is the one teacher
        (key "default", all rows); with other entries named, each needs a key and a model path."""
        named = {n: t for n, t in self.teacher_models.items() if n != DEFAULT_TEACHER}
        default = self.teacher_models.get(DEFAULT_TEACHER)
        if not named:
            check(default is not None and default.model_path is not None, f"teacher_models.{DEFAULT_TEACHER}.model_path",
                  None, "a local teacher model directory with enabled=true")
            per = default.inference.per_replica_world_size
            check(self.pool_size % per == 0, "n_gpus_per_node", self.n_gpus_per_node,
                  f"with nnodes={self.nnodes}, a multiple of the teacher's per-replica size {per} (tensor x data x "
                  "pipeline parallel), as verl requires")
            return {"default": default}
        check(default is None or default.model_path is None, f"teacher_models.{DEFAULT_TEACHER}.model_path",
              default and default.model_path, f"unset beside {', '.join(named)}: verl silently drops the default "
              f"entry once other teachers are named; give this teacher a name of its own (+distillation.teacher_models.<name>.*)")
        out = {}
        for name, t in named.items():
            check(t.model_path is not None, f"teacher_models.{name}.model_path", None, "a local teacher model directory")
            check(t.key is not None, f"teacher_models.{name}.key", None,
                  f"the {self.teacher_key} value whose rows this teacher scores (several teachers route by it)")
            check(t.key not in out, f"teacher_models.{name}.key", t.key, "unique: another teacher has this key")
            out[t.key] = t
        if self.pool_size:
            total = sum(t.num_replicas * t.inference.per_replica_world_size for t in out.values())
            check(total == self.pool_size, "nnodes x n_gpus_per_node", f"{self.nnodes} x {self.n_gpus_per_node}",
                  f"the teacher pool's {self.pool_size} devices must equal the teachers' num_replicas x per-replica "
                  f"sizes summed ({total}), as verl requires")
        return out


def no_effect(cfg: DistillationConfig, user: dict, backend: str) -> dict[str, str]:
    """The teacher keys set that have no effect here: key -> why (plait.config names them in its start block)."""
    if not cfg.enabled:
        return {}
    engine = ("a teacher's serving-engine settings: plait's teachers score the student's tokens with a transformers "
              "forward pass in its own workers")
    parallel = ("a teacher's parallel sizes: each teacher worker holds whole teachers (no tensor or pipeline "
                "parallelism); the sizes enter only verl's check of the teacher pool's size")
    out = {}
    for key in user:
        parts = key.split(".")
        if parts[:2] == ["distillation", "teacher_models"] and len(parts) >= 5 and parts[3] == "inference":
            why = engine if parts[4] in ENGINE_KEYS else parallel if parts[4] in PARALLEL_KEYS else None
            if why:
                out[key] = why
        elif backend == "local" and key in ("distillation.nnodes", "distillation.n_gpus_per_node"):
            out[key] = "the teacher pool's size: the local backend runs the teachers in this process"
    return out


def notes(cfg: DistillationConfig) -> list[str]:
    """verl's warnings about teacher settings, as start lines."""
    if not cfg.enabled:
        return []
    lines = [f"plait: teacher {key!r}: inference.temperature={t.inference.temperature} has no effect: the teacher's "
             "log-probs are at temperature 1.0, as verl computes them"
             for key, t in cfg.teachers().items() if t.inference.temperature not in (None, 1.0)]
    if cfg.distillation_loss.use_policy_gradient and cfg.distillation_loss.loss_mode in DISTILLATION_TOPK_MODES:
        lines.append("plait: distillation.distillation_loss.loss_mode=forward_kl_topk with use_policy_gradient=true: "
                     "the update then uses only the sampled token's log-prob, so most of the top-k signal is unused "
                     "(verl warns the same; use_policy_gradient=false backpropagates the top-k loss)")
    return lines


def check_lengths(cfg: DistillationConfig, prompt_length: int, response_length: int) -> None:
    """verl's check: the student's prompt and response and one token must fit each teacher's max_model_len."""
    for name, t in cfg.teacher_models.items():
        need, limit = prompt_length + response_length + 1, t.inference.max_model_len
        if cfg.enabled and limit is not None and need > limit:
            raise ConfigError(f"distillation.teacher_models.{name}.inference.max_model_len", limit,
                              f">= {need}: the teacher reads the student's prompt ({prompt_length}) and whole "
                              f"response ({response_length}) plus one token, as verl requires")
