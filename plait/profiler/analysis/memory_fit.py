"""The peak memory a verdict's suggestion would reach, per role, fitted from the run's own per-stage peaks.

    metrics.jsonl: memory/<stage>/peak_<counter>_gb, median over the verdict's steps (Facts.metrics)
      ─▶ F, the fixed part: the lowest stage's peak (weights, optimizer state, the runtime: held all step)
      ─▶ each stage's token part: its peak − F, taken as linear in the tokens one of its micro-batches
         holds (samples × the batch's padded width: longest prompt + longest response)
      ─▶ the suggestion changes some stages' tokens (`token_ratios`): such a stage's peak becomes
         F + (peak − F) × tokens after / tokens now; the others keep theirs
      ─▶ a role's peak: the highest of its stages' (ROLE_OF); the process's: the highest of all

The counter is the allocator's peak_allocated on CUDA and the process's peak RSS on CPU, as the stages
record them (plait/profiler/timeline.py StagePeaks). On the local backend every role runs in the process
that records them, so a role's peak is the process's while that role works; the Ray backend's workers
record none, so nothing is predicted there. A suggestion that raises the process's peak to MEMORY_FULL of
the device's memory (summary.json's settings: the GPU's; on CPU the host's) is not offered as printed.

Left out (one run gives one size per stage, so each stage has one slope and no intercept of its own):
- what a stage allocates once whatever its micro-batch (update_actor's gradients) counts as token work:
  a larger micro-batch is over-predicted, a smaller one under-predicted;
- attention scores materialised per sequence grow with its square: a longer sequence is under-predicted;
- the allocator's cache and fragmentation (CUDA's reserved beyond allocated); on CPU the memory malloc
  keeps after a free: steady-state stages tie at the process's resident size, the token parts read
  near 0 and the prediction is about today's peak;
- other processes: Ray workers, a vLLM engine, reward worker processes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from plait.modes import MODES, SYNC, Mode

# the run's facts (verdict.py's Facts: settings, metrics) and the sizes both modules read; verdict.py imports them
PADDING = "global_seqlen/padding_ratio"
MEMORY_FULL = 0.90     # a stage's peak >= 90 % of the device's memory
TOKEN_END = "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end"

ROLE_OF = {"gen": "rollout", "old_log_prob": "actor", "update_actor": "actor", "ref": "ref", "values": "critic",
           "update_critic": "critic"}  # the stages whose memory grows with the tokens of a micro-batch
COUNTERS = ("peak_allocated_gb", "peak_rss_gb")  # CUDA's, CPU's: reserved is the allocator's cache, left out
MICRO = {  # key -> (the stage whose micro-batch it sizes, the rows one such pass splits on a rank: "mini" / "rows")
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("update_actor", "mini"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("old_log_prob", "rows"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("ref", "rows"),
    "critic.ppo_micro_batch_size_per_gpu": ("update_critic", None),
}
BUDGET = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
UNCHANGED = ("trainer.test_freq", "trainer.save_freq", "global_profiler.steps", TOKEN_END, "reward.num_workers")


def stage_peaks(f) -> tuple[str, dict[str, float]]:
    """(counter, stage -> its peak in GB, median over the verdict's steps); `step` left out: it folds in the others."""
    found: dict[str, dict[str, float]] = {}
    for k, v in f.metrics.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "memory" and parts[1] != "step" and parts[2] in COUNTERS:
            found.setdefault(parts[2], {})[parts[1]] = v
    counter = next((c for c in COUNTERS if c in found), COUNTERS[-1])
    return counter, found.get(counter, {})


def role_peaks(peaks: dict[str, float]) -> dict[str, float]:
    """"process" -> the highest stage peak, and each role in ROLE_OF -> its stages' highest."""
    out = {"process": max(peaks.values())} if peaks else {}
    for stage, gb in peaks.items():
        if stage in ROLE_OF:
            out[ROLE_OF[stage]] = max(out.get(ROLE_OF[stage], 0.0), gb)
    return out


def token_ratios(f, key: str, value: Any) -> Optional[dict[str, float]]:
    """stage -> tokens one of its micro-batches holds with `key=value` over today's; {} for a key that changes
    no stage's micro-batch; None for a key the model does not cover (modes, staleness, devices, engines)."""
    s, m = f.settings, f.metrics
    if key in UNCHANGED:
        return {}
    world = world_size(f)
    rows = math.ceil(update_rows(f) / world)  # one rank's share of a log-prob pass
    mini = s.get("actor_rollout_ref.actor.ppo_mini_batch_size", 0) * s.get("actor_rollout_ref.rollout.n", 1)
    mini = math.ceil(mini / world)  # one rank's share of an optimizer step
    now = s.get(key)
    if key in MICRO:  # a micro-batch never holds more rows than the pass it splits; null: all of them at once
        stage, of = MICRO[key]
        cap = {"mini": mini, "rows": rows, None: math.inf}[of]
        before = min(now or cap, cap)
        return {stage: min(value or cap, cap) / before} if before and math.isfinite(before) else None
    if key == BUDGET and now:  # a token budget holds at most one rank's mini-batch tokens
        cap = m.get("global_seqlen/real_tokens", math.inf) / max(rows * world, 1) * mini
        return {"update_actor": min(value, cap) / min(now, cap)}
    prompt, resp = m.get("prompt_length/max"), m.get("response_length/max")
    if key == "data.max_response_length" and prompt and resp and now:
        new = min(value, resp) if value < now else value  # a raised limit: taken as reached (the most it holds)
        return {stage: (prompt + new) / (prompt + resp) for stage in ROLE_OF}
    if key == "actor_rollout_ref.model.use_remove_padding" and value:
        real = 1 - m.get(PADDING, 0.0)  # packed: the real tokens only
        return {stage: real for stage in ROLE_OF if stage != "gen"}
    return None


def predict(f, key: str, value: Any) -> dict:
    """`key=value`'s predicted peaks: {"counter", "fixed_gb", "stages": {stage: {"now_gb", "tokens_ratio",
    "after_gb"}} for the stages it changes, "now" and "after": role -> GB ("process" included)}; {"why": ...}
    when nothing is predicted."""
    if f.settings.get("trainer.backend") == "ray":
        return {"why": "the Ray backend's workers record no per-stage memory: only the driver's process is measured"}
    counter, peaks = stage_peaks(f)
    if not peaks:
        return {"why": "the run's records hold no per-stage memory peaks (memory/<stage>/peak_*_gb)"}
    ratios = token_ratios(f, key, value)
    if ratios is None:
        return {"why": f"{key} is not in the memory model (it changes more than a micro-batch's tokens)"}
    fixed = min(peaks.values())
    after = {st: fixed + (gb - fixed) * ratios.get(st, 1.0) for st, gb in peaks.items()}
    return {"counter": counter, "fixed_gb": fixed,
            "stages": {st: {"now_gb": peaks[st], "tokens_ratio": r, "after_gb": after[st]} for st, r in ratios.items()
                       if st in peaks},
            "now": role_peaks(peaks), "after": role_peaks(after)}


def attach(v, f) -> Optional[str]:
    """Puts the suggestion's predicted peaks on its verdict (`memory`; `predicted`: peak_gb for the process and
    <role>_peak_gb for each role it changes; the expected text) and returns why it is not offered as printed:
    it raises the process's peak to MEMORY_FULL of the device's memory (with the largest micro-batch that
    stays under, where the key is one). None when it may be offered."""
    v.memory = predict(f, v.key, v.value)
    if "why" in v.memory or not v.memory["stages"]:
        return None
    now, after, cap = v.memory["now"], v.memory["after"], f.settings.get("memory_capacity_gb")
    roles = {ROLE_OF[st] for st in v.memory["stages"] if st in ROLE_OF}
    v.predicted.update({"peak_gb": after["process"], **{f"{r}_peak_gb": after[r] for r in sorted(roles)}})
    v.expected += f"; process peak memory about {after['process']:.3g} GB instead of {now['process']:.3g} GB"
    if not cap or after["process"] <= now["process"] or after["process"] < MEMORY_FULL * cap:
        return None
    why = (f"its predicted process peak {after['process']:.3g} GB is {100 * after['process'] / cap:.0f} % of the "
           f"device's {cap:.3g} GB (at or above {100 * MEMORY_FULL:.0f} %: out of memory likely)")
    if v.key in MICRO and isinstance(v.value, int):
        fits = next((n for n in range(v.value - 1, (f.settings.get(v.key) or 0), -1)
                     if predict(f, v.key, n)["after"]["process"] < MEMORY_FULL * cap), None)
        if fits:
            why += f"; {v.key}={fits} is predicted to stay under"
    return why


def run_mode(f) -> Mode:
    """The run's row of plait/modes.py; a mode this plait does not know (another version's profile) reads as a
    mode with none of the facts the rules ask about."""
    return MODES.get(f.settings.get("trainer.mode", SYNC), Mode(lm=False))


def world_size(f) -> int:
    """The actor's data-parallel ranks: Ray's trainer processes (CPU) or GPUs; one on the local backend."""
    s = f.settings
    if s.get("trainer.backend") != "ray":
        return 1
    if s.get("device") == "cpu":
        return s.get("trainer.ray.num_cpu_workers", 1)
    return s.get("trainer.nnodes", 1) * s.get("trainer.n_gpus_per_node", 1)


def update_rows(f) -> int:
    """The responses one update reads (every rank's): the step's, or in a streaming mode one local update's."""
    s = f.settings
    n = s.get("actor_rollout_ref.rollout.n", 1)
    if run_mode(f).streams:
        return s.get("actor_rollout_ref.actor.ppo_mini_batch_size", 0) * s.get("async_training.require_batches", 1) * n
    return s.get("data.train_batch_size", 0) * n
