"""The verdict: which stage or role bounds the step, and which verl key to try, from a run's records.

    timeline.jsonl ─▶ accounting.account ─┐
    metrics.jsonl (per-step records) ─────┼─▶ facts(...) ─▶ Facts ─▶ each rule in RULES ─▶ verdicts()
    summary.json (wall split, settings) ──┘                          (pure, one per bottleneck)

A rule is a small pure function of `Facts` returning a `Verdict` or None. `verdicts` keeps those
that could save at least MIN_SAVING of the step (or of the run's wall time, for validation,
checkpoints and the profiler), one per key, and ranks them by that saving: at most three lines
`<where> is N % of the step (median over the steps); driven by <what>; try <key>=<value>
(expected: <the bound it moves>)`, each with the numbers it rests on (`evidence`) and its inputs and
predicted bound (`inputs`, `predicted`: verdict.json). Nothing stands out, nothing is said.

Every share is of the step's whole cycle (profiler/analysis/accounting.py: stages, the time between
steps and what no span names), so unattributed time is never ignored: it has its own rule. The steps
read are those outside profiler windows (a window slows its steps and closes with `profiler_stop`),
less the run's first (its warm-up) while another remains; when every step was profiled, each cycle
without the profiler's own spans. Each cycle is read without its validation and checkpoint (they come
every test_freq / save_freq steps; the overhead rules read them from the wall time). The profiler's
cost is not a verdict but a line of its own (`profiler_line`), so profiling a run does not change what
it is told.
A rule suggests only keys that act on the run's backend and device (config_verl's tables of keys with
no effect there) and that this machine's CPUs and GPUs can carry (`cannot_carry`), printed with every key
the suggestion needs (`also`: one_step_off's placement) so the line runs as printed; each prediction
is computed for the value it suggests (`predicted`, the quantity `plait profile diff` measures in the
rerun), its peak memory per role too (memory_fit.py: a suggestion that would fill the device's memory is not
offered as printed). The thresholds are the constants below; docs/profiling.md says what each rule means. What is left out:
multi-node placement advice, kernels (the report's top operators), and anything the records lack
(a run from before summary.json carried `settings` gets only the rules that need none).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from plait.modes import MODES, ONE_STEP_OFF, SYNC
from plait.profiler.analysis.accounting import UNATTRIBUTED, StepTime, median_shares
from plait.profiler.analysis.memory_fit import (MEMORY_FULL, PADDING, TOKEN_END, attach, run_mode, update_rows,
                                                world_size)
from plait.profiler.analysis.alarms import CAVEAT
from plait.profiler.timeline import ROLLOUT_WORK, rank_stages

MIN_SAVING = 0.10      # a verdict must be able to save >= 10 % of the step (or of the run's wall time)
GEN_SHARE = 0.40       # sync: generation >= 40 % of the step is generation-bound (overlap it) ...
OVERLAP_SAVING = 0.30  # ... and a training-bound sync run whose overlap would hide >= 30 % is told so too
IDLE_HIGH = 0.30       # async: a side that waits >= 30 % of the step is starved ...
IDLE_LOW = 0.10        # ... and one that waits < 10 % is the bottleneck
IDLE_MARGIN = 0.05     # ... each by this margin: a ratio within it of its threshold is too close to call (the
#                        idle ratios of identical runs vary by about that much), so no side is named
TAIL_RATIO = 3.0       # response length p99 / median >= 3: the tail holds generation
TAIL_GEN_SHARE = 0.25  # ... when generation is >= 25 % of the step (sync) or the trainer waits on it
REWARD_SHARE = 0.20    # reward >= 20 % of the step
JUDGE_SHARE = 0.20     # the judge's engine rounds (a GenRM, inside reward) >= 20 % of the step
FULL_ROUNDS = 0.75     # ... with rounds of >= 75 % of reward.num_workers requests: as full as the workers make them
SYNC_SHARE = 0.15      # weight sync >= 15 % of the step
UPDATE_SHARE = 0.40    # update_actor >= 40 % of the step, with a cause below
MICRO_BATCHES = 4      # >= 4 micro-batches per optimizer step: raise the micro-batch
UPDATE_OVER_FORWARD = 3.0  # a forward + backward ~ 3 forwards over the same tokens (old_log_prob's)
PADDING_SHARE = 0.30   # ... or >= 30 % of the batch's tokens are padding, unpacked
LOG_PROB_SHARE = 0.30  # old_log_prob + ref (forwards only) >= 30 % of the step, in >= MICRO_BATCHES forwards each
OVERHEAD_SHARE = 0.25  # validation / checkpoints / profiler >= 25 % of the run's wall time ...
OVERHEAD_TARGET = 0.10  # ... and the suggested frequency brings it to about 10 %
HOLE_SHARE = 0.15      # unattributed >= 15 % of the step
BYPASS_SHARE = 0.15    # sync: old_log_prob >= 15 % of the step ...
BYPASS_DIFF = 1e-5     # ... while the rollout's token probabilities are within this of the actor's (median over the
#                        steps of training/rollout_probs_diff_max): its log-probs are the actor's, and pi_old may be them

# The config keys the rules read, stored in summary.json as `settings`, each with the kind of value it
# holds (one place for the list: a summary.json setting of another kind is not read, inputs.clean_summary).
SETTINGS = {
    "trainer.mode": "str", "trainer.placement": "str", "trainer.backend": "str", "trainer.n_gpus_per_node": "int",
    "trainer.nnodes": "int", "trainer.ray.num_cpu_workers": "int", "trainer.test_freq": "int", "trainer.save_freq": "int",
    "trainer.val_before_train": "bool", "data.train_batch_size": "int", "data.max_response_length": "int",
    "actor_rollout_ref.rollout.n": "int", "actor_rollout_ref.rollout.name": "str",
    "actor_rollout_ref.rollout.n_gpus_per_node": "int", "actor_rollout_ref.rollout.tensor_model_parallel_size": "int",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "int", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "int?",
    "actor_rollout_ref.actor.ppo_epochs": "int", "actor_rollout_ref.actor.use_dynamic_bsz": "bool",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "int?", "actor_rollout_ref.model.enable_gradient_checkpointing": "bool",
    "actor_rollout_ref.model.use_remove_padding": "bool", "reward.num_workers": "int",
    "reward.custom_reward_function.path": "str?", "async_training.staleness_threshold": "num",
    "async_training.trigger_parameter_sync_step": "int", "async_training.require_batches": "int",
    "async_training.partial_rollout": "bool", "global_profiler.tool": "str?", "global_profiler.steps": "ints?",
    "actor_rollout_ref.rollout.profiler.enable": "bool", "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end": "int?",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "int?", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "int?",
    "critic.ppo_micro_batch_size_per_gpu": "int?", "actor_rollout_ref.rollout.max_num_seqs": "int?",
    "reward.reward_model.rollout.response_length": "int?", "reward.reward_model.rollout.full_determinism": "bool",
    "trainer.ray.cpus_per_worker": "num", "trainer.num_threads": "int", "algorithm.rollout_correction.bypass_mode": "bool",
    "algorithm.adv_estimator": "str",
    "memory_capacity_gb": "num?", "device": "str?", "cpus": "int?", "gpus": "int?",
}


def fits(value, kind: str) -> bool:
    """Whether a setting's value is of its kind ("int", "num", "bool", "str", "ints"; "?": or null)."""
    if kind.endswith("?"):
        return value is None or fits(value, kind[:-1])
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return {"int": isinstance(value, int) and number, "num": number, "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "ints": isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)}[kind]


PROFILER_SPANS = ("profiler_start", "profiler_stop", "finish_hook")  # the profiler's own time between steps
OCCASIONAL = ("testing", "save_checkpoint")  # every test_freq / save_freq steps: not the step's own time
BETWEEN = ("log", *PROFILER_SPANS)  # the lifecycle's own spans
SLOWDOWN_SPREAD = 0.20  # a profiled step's ratio to unprofiled ones is said only when theirs spread <= 20 %
NOT_TRAINING = ("gen", "wait_rollout", "testing", "save_checkpoint", UNATTRIBUTED, *BETWEEN)
WALL = "of the run's wall time after start-up"


@dataclass
class Facts:
    """What the rules read: medians over the steps, the run's wall split and its settings."""
    steps: int
    step_s: float                         # median cycle of the trainer (accounting.py)
    trainer: dict[str, float]             # part -> median share of the step (trainer thread)
    trainer_s: dict[str, float]           # part -> median seconds per step
    rollouter: dict[str, float]           # the async rollouter thread's parts (shares); {} in sync
    rollout_busy_s: float                 # median generate + resume seconds per step on that thread
    metrics: dict[str, float]             # median over the steps of each numeric metric
    wall: dict[str, float]                # summary.json's wall_s ({} when absent)
    settings: dict[str, Any]              # SETTINGS from summary.json ({} when absent)
    memory_peak: Optional[dict] = None    # summary.json's memory_peak (gb, stage, metric, step)
    basis: str = "median over the steps"  # which steps the medians are over (profiled ones left out)
    profiled: list[int] = field(default_factory=list)   # steps inside profiler windows
    profiler: dict = field(default_factory=dict)        # the profiler's own cost (profiler_cost)
    ranks: dict = field(default_factory=dict)           # "role/stage" -> rank -> {"s", "wait_s"} medians
    step_p90: float = 0.0                               # the cycles' 90th percentile (nearest rank), same steps


@dataclass
class Verdict:
    rule: str
    where: str                 # the stage or role
    share: float               # of the step (or of the wall time: `basis`)
    basis: str
    driver: str
    key: str
    value: Any
    expected: str
    saving: float              # share of the step (or wall) it could save: the ranking
    evidence: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    advice: str = "see the Gantt's gaps"   # what to look at when no key helps (key "")
    memory: dict = field(default_factory=dict)  # the suggestion's predicted peaks per role (memory_fit.py)
    also: dict = field(default_factory=dict)  # keys set with `key` (a mode's placement): the line prints them all

    def overrides(self) -> dict:
        """Every key the suggestion sets, as printed: `key` first."""
        return {self.key: self.value, **self.also} if self.key else {}

    def line(self) -> str:
        try_ = ("try " + " ".join(f"{k}={_value(v)}" for k, v in self.overrides().items()) if self.key
                else f"try: {self.advice}")
        return (f"{self.where} is {100 * self.share:.0f} % {self.basis}; driven by {self.driver}; {try_} "
                f"(expected: {self.expected})")

    def as_dict(self) -> dict:
        return {**asdict(self), "line": self.line()}


def _of_step(f: Facts) -> str:
    return f"of the step ({f.basis})"


def _count(n: int, noun: str) -> str:
    """"1 sample", "4 samples": a verdict line is read by people."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v).replace(" ", "")


# -- the facts ----------------------------------------------------------------------------------

def facts(steps: list[StepTime], metrics: list[dict], summary: Optional[dict], spans: Optional[list[dict]] = None) -> Facts:
    """Facts from the accounted steps, metrics.jsonl's step records, summary.json (or None) and the
    timeline's spans (the profiler's windows and cost, the workers' per-rank spans)."""
    summary, spans = summary or {}, spans or []
    profiled = profiled_steps(spans)
    kept = [st for st in steps if st.step not in profiled]
    # the run's first step warms up (allocations, lazy inits, a cold cache): left out while another step is read
    warm = min((st.step for st in steps), default=None)
    after_warmup = ", after the first (warm-up)" if len(kept) > 1 and kept[0].step == warm else ""
    kept = kept[1:] if after_warmup else kept
    if kept:
        basis = ("median over the steps" if not profiled else
                 f"median over the {len(kept)} step{'s' if len(kept) > 1 else ''} outside profiler windows") + after_warmup
    else:  # every step profiled: each cycle less the profiler's own spans (its recording still slows the stages)
        kept = [without(st, PROFILER_SPANS) for st in steps]
        basis = "median over the steps" + (", the profiler's own time taken out" if profiled else "")
    kept = [without(st, OCCASIONAL) for st in kept]  # validation and checkpoints: their own rules read the wall time
    chosen = {st.step for st in kept}
    metrics = [m for m in metrics if m.get("step") in chosen] or metrics
    lanes = list(kept[0].lanes) if kept else []
    trainer_lane = lanes[0] if lanes else None
    rollouter = next((n for n in lanes[1:] if n.startswith("rollout (") and n != "rollout (MainThread)"), None)
    walls = [st.wall for st in kept if st.wall > 0]
    busy = [sum(v for k, v in st.lanes.get(rollouter, {}).items() if k in (*ROLLOUT_WORK, "generate")) for st in kept]
    numeric = {k for m in metrics for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Facts(
        steps=len(walls), step_s=statistics.median(walls) if walls else 0.0,
        step_p90=sorted(walls)[min(int(0.9 * len(walls)), len(walls) - 1)] if walls else 0.0,
        trainer=median_shares(kept, trainer_lane) if trainer_lane else {},
        trainer_s=_median_seconds(kept, trainer_lane) if trainer_lane else {},
        rollouter=median_shares(kept, rollouter) if rollouter else {},
        rollout_busy_s=statistics.median(busy) if rollouter and busy else 0.0,
        metrics={k: statistics.median(m[k] for m in _idle_steps(k, metrics, steps, summary) if isinstance(m.get(k), (int, float)))
                 for k in numeric},
        wall=summary.get("wall_s") or {}, settings=summary.get("settings") or {},
        memory_peak=summary.get("memory_peak"), basis=basis, profiled=sorted(profiled),
        profiler=profiler_cost(steps, profiled, spans), ranks=rank_facts(spans, chosen))


IDLE_KEYS = ("trainer/idle_ratio", "rollouter/idle_ratio")


def _idle_steps(key: str, metrics: list[dict], steps: list[StepTime], summary: dict) -> list[dict]:
    """The records an idle ratio's median reads: an overlapping mode's last step winds down (its rollouter has
    made every batch and is done, the trainer trains the last), so it is not the run's steady state and is left
    out while another step remains, as the first step's warm-up is."""
    mode = MODES.get((summary.get("settings") or {}).get("trainer.mode", SYNC))
    last = max((st.step for st in steps), default=None)
    if key not in IDLE_KEYS or mode is None or not mode.idle_pair:
        return metrics
    return [m for m in metrics if m.get("step") != last] or metrics


def profiled_steps(spans: list[dict]) -> set[int]:
    """Steps inside profiler windows: from a `profiler_start` to the next `profiler_stop` on the trainer."""
    out, open_ = set(), False
    for s in sorted((s for s in spans if s["role"] == "trainer" and s.get("rank") is None
                     and s["stage"] in ("profiler_start", "profiler_stop", "step")), key=lambda s: s["start"]):
        if s["stage"] == "profiler_start":
            open_ = True
        elif s["stage"] == "step" and open_:
            out.add(s["step"])
        elif s["stage"] == "profiler_stop":
            open_ = False
    return out


def without(st: StepTime, stages: tuple[str, ...]) -> StepTime:
    """A step's cycle less the trainer's spans of `stages` (the profiler's own, validation, checkpoints)."""
    lanes = dict(st.lanes)
    first = next(iter(lanes), None)
    if first is None:
        return st
    own = sum(lanes[first].get(k, 0.0) for k in stages)
    lanes[first] = {k: v for k, v in lanes[first].items() if k not in stages}
    return StepTime(st.step, st.start, max(st.wall - own, 0.0), lanes)


def profiler_cost(steps: list[StepTime], profiled: set[int], spans: list[dict]) -> dict:
    """The profiler's own cost: windows, seconds starting / stopping and writing / in the finish hook,
    and how much longer a profiled step's stages ran than an unprofiled one's (`slowdown`, medians). The
    steps compared are read as the verdict's are: without the run's first (its warm-up), each cycle without
    validation and checkpoints. The ratio is said only against at least two unprofiled steps whose own times
    spread (max − min over median, `spread`) by at most SLOWDOWN_SPREAD: against one step, the warm-up or
    steps that noisy it read anything from 0.18x to 1.18x on identical runs. Otherwise `slowdown` is None
    and `unsaid` says why."""
    own = {k: sum(s["end"] - s["start"] for s in spans if s["role"] == "trainer" and s["stage"] == k
                  and s.get("rank") is None) for k in PROFILER_SPANS}
    windows = sum(1 for s in spans if s["role"] == "trainer" and s["stage"] == "profiler_start" and s.get("rank") is None)
    warm = min((st.step for st in steps), default=None)
    steady = [without(st, PROFILER_SPANS + OCCASIONAL) for st in steps if st.step != warm]
    inside = [st.wall for st in steady if st.step in profiled]
    outside = [st.wall for st in steady if st.step not in profiled]
    usual = statistics.median(outside) if outside else 0.0
    spread = (max(outside) - min(outside)) / usual if len(outside) > 1 and usual > 0 else None
    unsaid = _slowdown_unsaid(inside, spread) if profiled else None
    slowdown = statistics.median(inside) / usual if profiled and unsaid is None else None
    return {"windows": windows, "start_s": own["profiler_start"], "stop_s": own["profiler_stop"],
            "hook_s": own["finish_hook"], "total_s": sum(own.values()),
            "steps": sum(1 for st in steps if st.step in profiled), "slowdown": slowdown, "spread": spread,
            "unsaid": unsaid}


def _slowdown_unsaid(inside: list[float], spread: Optional[float]) -> Optional[str]:
    """Why a profiled step's ratio to unprofiled ones would mean nothing; None when it can be said."""
    if not inside:
        return "the only profiled step was the run's first (its warm-up)"
    if spread is None:
        return "fewer than two unprofiled steps after the first (the warm-up) to compare with"
    if spread > SLOWDOWN_SPREAD:
        return f"the unprofiled steps' own times spread {_pct(spread)} (over {100 * SLOWDOWN_SPREAD:.0f} %)"
    return None


def rank_facts(spans: list[dict], steps: set[int]) -> dict[str, dict[int, dict[str, float]]]:
    """"role/stage" -> rank -> {"s": median seconds per step, "wait_s": of it in collectives}, over `steps`,
    from the workers' own spans (Ray); stages run by one rank are left out."""
    per_step: dict[int, list[tuple]] = {}
    for s in spans:
        if s.get("rank") is not None and s["step"] in steps:
            per_step.setdefault(s["step"], []).append((s["role"], s["stage"], s["rank"], s["pid"], s.get("tid"),
                                                       s["start"], s["end"]))
    seen: dict[tuple, dict[int, list[list[float]]]] = {}
    for group in per_step.values():
        for key, ranks in rank_stages(group).items():
            for rank, (total, wait) in ranks.items():
                seen.setdefault(key, {}).setdefault(rank, []).append([total, wait])
    return {f"{role}/{stage}": {r: {"s": statistics.median(v[0] for v in vals), "wait_s": statistics.median(v[1] for v in vals)}
                                for r, vals in sorted(ranks.items())}
            for (role, stage), ranks in seen.items() if len(ranks) > 1}


def _median_seconds(steps: list[StepTime], lane: str) -> dict[str, float]:
    parts = {k for st in steps for k in st.lanes.get(lane, {})}
    return {k: statistics.median(st.lanes.get(lane, {}).get(k, 0.0) for st in steps) for k in parts}


def training_s(f: Facts) -> float:
    """The trainer's own work per step: every part but generation, waits, validation, checkpoints,
    the lifecycle's spans and the unattributed."""
    return sum(v for k, v in f.trainer_s.items() if k not in NOT_TRAINING)


def responses_per_step(f: Facts) -> Optional[int]:
    s = f.settings
    if "data.train_batch_size" not in s or "actor_rollout_ref.rollout.n" not in s:
        return None
    per = s["data.train_batch_size"] * s["actor_rollout_ref.rollout.n"]
    return per * s.get("async_training.trigger_parameter_sync_step", 1) if run_mode(f).streams else per


# -- the rules ----------------------------------------------------------------------------------

def generation_bound(f: Facts) -> Optional[Verdict]:
    """Sync, generation >= GEN_SHARE (or training-bound with an overlap saving >= OVERLAP_SAVING):
    overlap generation with training (one_step_off); the step is then bounded by the longer side (overlapped)."""
    gen, train = f.trainer_s.get("gen", 0.0), training_s(f)
    if f.settings.get("trainer.mode", SYNC) != SYNC or not f.step_s:
        return None
    # a sync run with one on-policy update takes pi_old from the update's own forward; one_step_off's samples are a
    # version behind, so it runs the old_log_prob forward the run skipped (about a third of a forward + backward)
    added = 0.0 if "old_log_prob" in f.trainer_s or f.settings.get("algorithm.rollout_correction.bypass_mode") else \
        f.trainer_s.get("update_actor", 0.0) / UPDATE_OVER_FORWARD
    side, cores = overlapped(f, gen, train + added)
    bound = f.step_s - gen - train + side  # the step's other parts (the lifecycle's, unattributed) stay
    saving = (f.step_s - bound) / f.step_s
    n, length = responses_per_step(f), f.metrics.get("response_length/mean")
    if f.trainer.get("gen", 0.0) >= GEN_SHARE and saving > 0:
        rule, where, share = "generation_bound", "gen (rollout)", f.trainer["gen"]
        what = (f"{n} responses per step (data.train_batch_size x rollout.n)" if n else "the responses per step") + (
            f" of {length:.0f} tokens on average" if length else "")
    elif saving >= OVERLAP_SAVING:
        rule, where, share = "training_bound", "training (reward to update_actor)", train / f.step_s
        what = f"{train:.3g} s of it after a generation of {gen:.3g} s that could run beside it"
    else:
        return None
    placement = MODES[ONE_STEP_OFF].placement  # the mode refuses the run's other placement: both keys, as printed
    also = {"trainer.placement": placement} if placement and f.settings.get("trainer.placement") != placement else {}
    evidence = [f"gen {gen:.3g} s of a {f.step_s:.3g} s step", f"training stages {train:.3g} s"] + (
        [f"plus the old_log_prob pass one_step_off needs (update_actor / {UPDATE_OVER_FORWARD:g}: {added:.3g} s)"]
        if added else []) + ([cores] if cores else [])
    return Verdict(rule, where, share, _of_step(f), what, "trainer.mode", ONE_STEP_OFF,
                   f"step >= max(gen {gen:.3g} s, training {train + added:.3g} s){' and the cores both need' if cores else ''}"
                   f": about {bound:.3g} s instead of {f.step_s:.3g} s; samples one policy version behind", saving,
                   evidence, {"gen_s": gen, "training_s": train, "old_log_prob_added_s": added, "step_s": f.step_s},
                   {"step_s": bound}, also=also)


def overlapped(f: Facts, gen: float, train: float) -> tuple[float, str]:
    """The step when generation runs beside training: the longer side; on a CPU also the core-seconds both sides
    need (each side's torch threads, at most the machine's CPUs, for its own time) over the CPUs: a side that
    takes every core leaves the other none to overlap on. The second value says so when it bounds the step."""
    bound, cpus = max(gen, train), f.settings.get("cpus")
    if f.settings.get("device") != "cpu" or not cpus:
        return bound, ""
    local = f.settings.get("trainer.backend", "local") == "local"
    threads = (f.settings.get("trainer.num_threads") if local else f.settings.get("trainer.ray.cpus_per_worker")) or cpus
    shared = (gen + train) * min(threads, cpus) / cpus
    if shared <= bound:
        return bound, ""
    return shared, (f"on {cpus} CPUs at {min(threads, cpus):g} torch threads a side, both sides share the cores: "
                    f"(gen + training) x {min(threads, cpus):g} / {cpus} = {shared:.3g} s")


def async_idle(f: Facts) -> Optional[Verdict]:
    """A mode whose rollout overlaps training (plait/modes.py idle_pair): verl #7601's reading of the idle-ratio pair."""
    t, r = f.metrics.get("trainer/idle_ratio"), f.metrics.get("rollouter/idle_ratio")
    mode, s = run_mode(f), f.settings
    if not mode.idle_pair or t is None or r is None:
        return None
    train, gen = training_s(f), f.rollout_busy_s
    evidence = [f"trainer/idle_ratio {t:.2f}", f"rollouter/idle_ratio {r:.2f}",
                f"training {train:.3g} s, generation {gen:.3g} s per step"]
    inputs = {"trainer_idle": t, "rollouter_idle": r, "training_s": train, "generation_s": gen, "step_s": f.step_s}
    wait = f.trainer.get("wait_rollout", t)
    if t >= IDLE_HIGH and r >= IDLE_HIGH and mode.streams:  # each waits for the other: the bound, not a side
        stale, trigger = s.get("async_training.staleness_threshold", 0), s.get("async_training.trigger_parameter_sync_step", 1)
        key, value = (("async_training.staleness_threshold", 1) if stale < 1 else
                      ("async_training.trigger_parameter_sync_step", 2 * trigger))
        bound = max(train, gen)
        return Verdict("async_both_idle", "the trainer's wait (while the rollouter waits too)", t, _of_step(f),
                       f"the staleness bound: each side waits for the other, the rollouter may not run ahead "
                       f"(staleness_threshold={stale:g}, trigger_parameter_sync_step={trigger})", key, value,
                       f"generation overlaps training: step about max(training, generation) = {bound:.3g} s instead of "
                       f"{f.step_s:.3g} s; samples up to "
                       f"{_count(max(1, math.ceil(value if key.endswith('threshold') else stale)), 'version')} behind",
                       1 - bound / f.step_s if f.step_s else 0.0, evidence, inputs, {"step_s": bound})
    if t >= IDLE_HIGH + IDLE_MARGIN and r < IDLE_LOW - IDLE_MARGIN:
        bound = max(train, gen / 2)
        key, value, how = more_devices(f, "rollout")
        return Verdict("rollout_bound", "trainer waiting on the rollout (wait_rollout)", wait, _of_step(f),
                       f"generation ({gen:.3g} s per step) while the rollouter is never idle", key, value,
                       f"{how}: step about max(training, generation / 2) = {bound:.3g} s",
                       1 - bound / f.step_s if f.step_s else 0.0, evidence, inputs, {"step_s": bound})
    if r >= IDLE_HIGH + IDLE_MARGIN and t < IDLE_LOW - IDLE_MARGIN:
        bound = max(train / 2, gen)
        waits = ", ".join(f"{k} {100 * v:.0f} %" for k, v in f.rollouter.items() if k.startswith("wait_"))
        key, value, how = more_devices(f, "trainer")
        return Verdict("trainer_bound", "rollouter waiting on the trainer", r, _of_step(f),
                       f"training ({train:.3g} s per step" + (f"; rollouter waits: {waits})" if waits else ")"), key, value,
                       f"{how}: step about max(training / 2, generation) = {bound:.3g} s",
                       1 - bound / f.step_s if f.step_s else 0.0, evidence, inputs, {"step_s": bound})
    return None


def more_devices(f: Facts, side: str) -> tuple[str, Any, str]:
    """(key, value, what it does) that gives `side` ("trainer" or "rollout") twice the devices on this run's
    backend and device; ("", None, why not) when no key does: the local backend runs every role in one
    process, the hf engine on a GPU uses one device, and a key config_verl names as having no effect here
    (or a run whose backend or device the records lack) is never suggested."""
    from plait.config_verl import CPU_RAY_NO_EFFECT, LOCAL_BACKEND_NO_EFFECT  # the tables of what acts where
    s = f.settings
    backend, device = s.get("trainer.backend"), s.get("device")
    if backend == "local" and device is not None:
        workers = {"trainer.backend": "ray", "trainer.ray.num_cpu_workers" if device == "cpu" else "trainer.n_gpus_per_node": 2}
        why = cannot_carry(workers, s)
        return "", None, "no key adds devices on the local backend (every role in this process); " + (
            f"trainer.backend=ray with 2 workers would, but {why}" if why else "trainer.backend=ray with more workers would")
    if backend != "ray" or device is None:
        return "", None, "the records do not say the run's backend and device, so no device key is suggested"
    if side == "rollout" and device != "cpu":
        from plait.workers.engine import ENGINES  # the engines' table says which key sets an engine's GPUs
        engine = s.get("actor_rollout_ref.rollout.name")
        rule = ENGINES[engine].devices_rule if engine in ENGINES else "1"
        if rule == "1":
            return "", None, f"the {engine or 'rollout'} engine uses one GPU: no device key helps"
        key = f"actor_rollout_ref.{rule}"  # rollout.n_gpus_per_node follows it
        now, what = s.get(key, 1), f"twice the rollout's GPUs ({rule}; rollout.n_gpus_per_node to match)"
    elif side == "rollout":
        key = "actor_rollout_ref.rollout.n_gpus_per_node"  # CPU Ray: that many cpus_per_worker slots of its process
        now, what = s.get(key, 1), "twice the rollout process's CPU slots"
    else:
        key = "trainer.ray.num_cpu_workers" if device == "cpu" else "trainer.n_gpus_per_node"
        now, what = s.get(key, 1), "twice the trainer's data-parallel ranks"
    if (backend == "local" and key in LOCAL_BACKEND_NO_EFFECT) or (device == "cpu" and key in CPU_RAY_NO_EFFECT):
        return "", None, f"{key} has no effect on this backend"
    return key, 2 * now, what


def response_tail(f: Facts) -> Optional[Verdict]:
    """A long response-length tail (p99 / median >= TAIL_RATIO) holds generation: every decode step
    waits for the longest response."""
    p99, med, top = (f.metrics.get(k) for k in ("response_length/p99", "response_length/median", "response_length/max"))
    if not p99 or not med or p99 / med < TAIL_RATIO:
        return None
    mode, s = f.settings.get("trainer.mode", SYNC), f.settings
    gen_share = f.trainer.get("gen", 0.0) if mode == SYNC else f.metrics.get("trainer/idle_ratio", 0.0)
    if gen_share < TAIL_GEN_SHARE:
        return None
    gen = f.trainer_s.get("gen", 0.0) if mode == SYNC else f.rollout_busy_s
    if run_mode(f).streams and not s.get("async_training.partial_rollout", True):
        key, value, cut = "async_training.partial_rollout", True, med / top
        what = "a sync no longer waits for the longest responses: they finish with the new weights"
    else:
        key, value = "data.max_response_length", int(2 * med)
        cut = min(1.0, value / top) if top else 1.0
        what = f"responses cut at {value} tokens (changes what is trained)"
    bound = gen * cut
    return Verdict("response_tail", "generation", gen_share, _of_step(f),
                   f"the response-length tail: p99 {p99:.0f} tokens, median {med:.0f} (x{p99 / med:.1f})", key, value,
                   f"{what}; generation about {bound:.3g} s instead of {gen:.3g} s",
                   (gen - bound) / f.step_s if f.step_s else 0.0,
                   [f"response_length/p99 {p99:.0f}", f"response_length/median {med:.0f}", f"generation {gen:.3g} s per step"],
                   {"p99": p99, "median": med, "max": top, "generation_s": gen}, {"generation_s": bound})


def reward_bound(f: Facts) -> Optional[Verdict]:
    """reward >= REWARD_SHARE with a custom reward: more reward worker processes (reward.num_workers)."""
    share, reward = f.trainer.get("reward", 0.0), f.trainer_s.get("reward", 0.0)
    if share < REWARD_SHARE or not f.settings.get("reward.custom_reward_function.path"):
        return None  # plait's built-in scorer runs in the trainer's process whatever num_workers says
    now = f.settings.get("reward.num_workers", 0)
    calls = responses_per_step(f) or 0
    new = min(8 if now == 0 else 2 * now, max(calls, 2))
    bound = reward * max(now, 1) / new
    where = "in the trainer's process" if now == 0 else f"on {now} worker processes"
    return Verdict("reward_bound", "reward", share, _of_step(f),
                   f"{calls} reward calls per step at {calls / reward:.0f}/s {where}" if reward else "the reward function",
                   "reward.num_workers", new, f"reward about {bound:.3g} s instead of {reward:.3g} s (calls in parallel); "
                   f"step about {f.step_s - reward + bound:.3g} s", (reward - bound) / f.step_s,
                   [f"reward {reward:.3g} s of a {f.step_s:.3g} s step", f"reward.num_workers={now}",
                    f"{calls} responses per step"],
                   {"reward_s": reward, "num_workers": now, "calls": calls, "step_s": f.step_s},
                   {"reward_s": bound, "step_s": f.step_s - reward + bound})


def judge_bound(f: Facts) -> Optional[Verdict]:
    """The judge >= JUDGE_SHARE: unseeded rounds (full_determinism samples each request alone), bigger rounds
    (more reward workers asking at once) when they are as full as the workers allow, else shorter verdicts when
    they run into their budget."""
    share, judge, m, s = f.trainer.get("judge", 0.0), f.trainer_s.get("judge", 0.0), f.metrics, f.settings
    if share < JUDGE_SHARE or not judge:
        return None
    workers, per_round = s.get("reward.num_workers", 0), m.get("judge/requests_per_round", 0.0)
    requests, rounds = m.get("judge/requests", 0.0), m.get("judge/rounds", 0.0)
    tokens, budget = m.get("judge/response_tokens/mean", 0.0), s.get("reward.reward_model.rollout.response_length")
    evidence = [f"judge {judge:.3g} s of a {f.step_s:.3g} s step",
                f"{requests:.0f} judge requests in {rounds:.0f} engine rounds ({per_round:.3g} a round)",
                f"reward.num_workers={workers}", f"{tokens:.0f} tokens a verdict (budget {budget})"]
    inputs = {"judge_s": judge, "requests": requests, "rounds": rounds, "num_workers": workers, "tokens": tokens}
    if s.get("reward.reward_model.rollout.full_determinism") and workers > 1:
        key, value, bound = "reward.reward_model.rollout.full_determinism", False, judge / workers
        what = f"rounds of up to {workers} requests instead of one (unseeded: verdicts then vary run to run)"
    elif workers and per_round >= FULL_ROUNDS * workers and requests > workers:
        key, value, bound = "reward.num_workers", 2 * workers, judge / 2
        what = f"judge rounds of up to {2 * workers} requests, half as many"
    elif budget and tokens >= 0.9 * budget:
        key, value, bound = "reward.reward_model.rollout.response_length", budget // 2, judge / 2
        what = "verdicts cut at half the tokens (a reward function that names max_tokens keeps its own)"
    else:
        return None
    return Verdict("judge_bound", "judge", share, _of_step(f), f"{requests:.0f} judge requests in {rounds:.0f} engine rounds",
                   key, value, f"{what}; judge about {bound:.3g} s instead of {judge:.3g} s if a round takes as long",
                   (judge - bound) / f.step_s, evidence, inputs, {"judge_s": bound})


def weight_sync(f: Facts) -> Optional[Verdict]:
    """The weight sync >= SYNC_SHARE: fewer syncs (fully_async) or an in-process one (colocated)."""
    stage = next((k for k in ("param_sync", "update_weights") if k in f.trainer), None)
    if stage is None or f.trainer[stage] < SYNC_SHARE:
        return None
    sync, s = f.trainer_s[stage], f.settings
    evidence = [f"{stage} {sync:.3g} s of a {f.step_s:.3g} s step"]
    if run_mode(f).streams:
        k = s.get("async_training.trigger_parameter_sync_step", 1)
        per_update = sync / k
        return Verdict("weight_sync", stage, f.trainer[stage], _of_step(f), f"one sync per {k} local update(s)",
                       "async_training.trigger_parameter_sync_step", 2 * k,
                       f"sync time per local update {per_update / 2:.3g} s instead of {per_update:.3g} s; samples "
                       "may be one more update behind", (sync / 2) / f.step_s, evidence + [f"trigger_parameter_sync_step={k}"],
                       {"sync_s": sync, "updates_per_sync": k}, {"sync_s_per_update": per_update / 2})
    if s.get("trainer.placement") == "separated" and s.get("trainer.mode") == SYNC:
        return Verdict("weight_sync", stage, f.trainer[stage], _of_step(f), "a copy of the weights to the rollout's own process",
                       "trainer.placement", "colocated", "the rollout reads the actor's weights in place: update_weights "
                       "near 0", sync / f.step_s, evidence + ["trainer.placement=separated"], {"sync_s": sync}, {"sync_s": 0.0})
    return None


def update_cost(f: Facts) -> Optional[Verdict]:
    """update_actor >= UPDATE_SHARE and a cause: many small micro-batches (by count, or by token budget
    with use_dynamic_bsz), padding without packing, or recomputation (gradient checkpointing). The
    micro-batch prediction is for the suggested value: `micro_batch_fit`."""
    share, update, s = f.trainer.get("update_actor", 0.0), f.trainer_s.get("update_actor", 0.0), f.settings
    if share < UPDATE_SHARE or not s:
        return None
    epochs, olp = s.get("actor_rollout_ref.actor.ppo_epochs", 1), f.trainer_s.get("old_log_prob", 0.0)
    mini = s.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    micro = s.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    n = s.get("actor_rollout_ref.rollout.n", 1)
    evidence = [f"update_actor {update:.3g} s of a {f.step_s:.3g} s step"] + ([f"old_log_prob {olp:.3g} s"] if olp else [])
    if f.metrics.get("perf/mfu/actor") is not None:
        evidence.append(f"the update runs at {_pct(f.metrics['perf/mfu/actor'])} of this device's measured matmul peak "
                        "(perf/mfu/actor)")
    room = _headroom(f)
    counts = micro_batches(f)
    if mini and micro and counts and not s.get("actor_rollout_ref.actor.use_dynamic_bsz") \
            and mini * n / micro >= MICRO_BATCHES and (room is None or room >= 0.5):  # larger micro-batches need the memory
        key, value = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", min(mini * n, micro * MICRO_BATCHES)
        driver = (f"{math.ceil(mini * n / micro)} micro-batches of {_count(micro, 'sample')} per optimizer step "
                  f"(ppo_mini_batch_size {mini} x rollout.n {n})")
        bound, how = micro_batch_fit(f, counts[0], micro_batches(f, value)[0], counts[1])
    elif s.get("actor_rollout_ref.actor.use_dynamic_bsz") and _token_budgets(f) >= MICRO_BATCHES and counts \
            and (room is None or room >= 0.5):
        budget = s["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
        key, value = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", budget * MICRO_BATCHES
        driver = f"about {_token_budgets(f):.0f} micro-batches of at most {budget} tokens per optimizer step (use_dynamic_bsz)"
        now = _token_budgets(f) * counts[2]
        bound, how = micro_batch_fit(f, now, max(now / MICRO_BATCHES, counts[2]), counts[1])
    elif not s.get("actor_rollout_ref.model.use_remove_padding", True) and f.metrics.get(PADDING, 0) >= PADDING_SHARE:
        pad = f.metrics[PADDING]
        key, value = "actor_rollout_ref.model.use_remove_padding", True
        driver = f"padding: {100 * pad:.0f} % of the batch's tokens"
        bound, how = update * (1 - pad), "the real tokens only (packed): the update's time scales with its tokens"
    elif s.get("actor_rollout_ref.model.enable_gradient_checkpointing") and room is not None and room >= 0.5:
        key, value, driver = "actor_rollout_ref.model.enable_gradient_checkpointing", False, \
            f"recomputing activations in the backward with {100 * room:.0f} % of memory free"
        bound, how = update * 0.75, "no recomputed forward (about a quarter of the update; more memory)"
    else:
        return None
    if update - bound < MIN_SAVING * f.step_s:
        return None
    return Verdict("update_cost", "update_actor", share, _of_step(f), driver, key, value,
                   f"update_actor about {bound:.3g} s instead of {update:.3g} s ({how})", (update - bound) / f.step_s,
                   evidence + [driver], {"update_s": update, "old_log_prob_s": olp, "ppo_epochs": epochs, "step_s": f.step_s},
                   {"update_s": bound, "step_s": f.step_s - update + bound})


LOG_PROB_KEYS = {"old_log_prob": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",  # stage -> its
                 "ref": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"}                # micro-batch key


def log_prob_cost(f: Facts) -> Optional[Verdict]:
    """old_log_prob + ref >= LOG_PROB_SHARE, each in >= MICRO_BATCHES forwards: larger log-prob micro-batches,
    up to the update's own micro-batch (a forward holds less than the training pass that already fits) or
    MICRO_BATCHES times the run's. A forward costs m·c + W (m micro-batches, c a micro-batch's fixed cost, W
    the batch's token work): c and W come from two stages over the same tokens at different micro-batch counts
    (old_log_prob and ref, else old_log_prob and update_actor as micro_batch_fit does); when neither pair
    differs, every forward is taken as fixed cost (the most it can save)."""
    s, rows = f.settings, rows_per_rank(f)
    times = {st: f.trainer_s[st] for st in LOG_PROB_KEYS if f.trainer_s.get(st)}
    share = sum(f.trainer.get(st, 0.0) for st in times)
    room = _headroom(f)
    if share < LOG_PROB_SHARE or not rows or not f.step_s or (room is not None and room < 0.5):
        return None
    micro = {st: min(s.get(LOG_PROB_KEYS[st]) or rows, rows) for st in times}
    count = {st: math.ceil(rows / m) for st, m in micro.items()}
    small = [st for st in times if count[st] >= MICRO_BATCHES]
    if not small:
        return None
    train_micro = s.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") or 1
    new = {st: min(rows, max(train_micro, MICRO_BATCHES * micro[st])) if st in small else micro[st] for st in times}
    c, w, how = _forward_fit(f, times, count)
    after = {st: (math.ceil(rows / new[st]) * c + w) if c is not None else times[st] * math.ceil(rows / new[st]) / count[st]
             for st in times}
    before, bound = sum(times.values()), sum(after.values())
    if before - bound < MIN_SAVING * f.step_s:
        return None
    first, *rest = sorted(small, key=lambda st: after[st] - times[st])  # the larger saving names the verdict
    driver = "; ".join(f"{st}: {count[st]} forwards of {_count(micro[st], 'sample')} ({LOG_PROB_KEYS[st].split('.')[1]}"
                       f".log_prob_micro_batch_size_per_gpu={s.get(LOG_PROB_KEYS[st])})" for st in small)
    return Verdict("log_prob_cost", " + ".join(times), share, _of_step(f), driver, LOG_PROB_KEYS[first], new[first],
                   f"{' + '.join(times)} about {bound:.3g} s instead of {before:.3g} s ({how}); step about "
                   f"{f.step_s - before + bound:.3g} s", (before - bound) / f.step_s,
                   [f"{st} {t:.3g} s of a {f.step_s:.3g} s step" for st, t in times.items()] + [driver],
                   {"log_prob_s": before, "stages_s": times, "micro_batches": count, "rows_per_rank": rows, "step_s": f.step_s},
                   {"log_prob_s": bound, "step_s": f.step_s - before + bound},
                   also={LOG_PROB_KEYS[st]: new[st] for st in rest})


def old_log_prob_bypass(f: Facts) -> Optional[Verdict]:
    """Sync, an old_log_prob pass that recomputes what the rollout returned: the rollout samples with the actor's
    weights, and its token probabilities match the actor's to <= BYPASS_DIFF, so verl's bypass mode (pi_old = the
    rollout's log-prob) trains on the same numbers without the pass. Not with an estimator that needs the pass's
    own outputs (optimal_token_baseline: config.py refuses it)."""
    s, olp, diff = f.settings, f.trainer_s.get("old_log_prob", 0.0), f.metrics.get("training/rollout_probs_diff_max")
    if (s.get("trainer.mode", SYNC) != SYNC or not f.step_s or olp < BYPASS_SHARE * f.step_s or diff is None
            or diff > BYPASS_DIFF or s.get("algorithm.rollout_correction.bypass_mode")
            or str(s.get("algorithm.adv_estimator", "")).endswith("optimal_token_baseline")):
        return None
    return Verdict("old_log_prob_bypass", "old_log_prob", olp / f.step_s, _of_step(f),
                   f"a forward that recomputes the rollout's own log-probs (the actor's probabilities match them to "
                   f"{diff:.1g})", "algorithm.rollout_correction.bypass_mode", True,
                   f"about {f.step_s - olp:.3g} s instead of {f.step_s:.3g} s; pi_old is then the rollout's log-prob, "
                   "the same numbers here", olp / f.step_s,
                   [f"old_log_prob {olp:.3g} s of a {f.step_s:.3g} s step",
                    f"training/rollout_probs_diff_max {diff:.2g} (median over the steps)"],
                   {"old_log_prob_s": olp, "rollout_probs_diff_max": diff, "step_s": f.step_s}, {"step_s": f.step_s - olp})


def _forward_fit(f: Facts, times: dict[str, float], count: dict[str, int]) -> tuple[Optional[float], float, str]:
    """(c, W, how) of a forward's m·c + W for log_prob_cost; c None when no two stages differ in m."""
    pairs = [(times[st], count[st]) for st in times]
    k = micro_batches(f)
    if k and f.trainer_s.get("update_actor"):  # a training pass is UPDATE_OVER_FORWARD forwards
        epochs = f.settings.get("actor_rollout_ref.actor.ppo_epochs", 1)
        pairs.append((f.trainer_s["update_actor"] / (UPDATE_OVER_FORWARD * epochs), k[0]))
    (t1, m1), pair = pairs[0], next(((t, m) for t, m in pairs[1:] if m != pairs[0][1]), None)
    if pair is None:
        return None, 0.0, "each forward taken as fixed cost: the most it can save"
    t2, m2 = pair
    c = max((t1 - t2) / (m1 - m2), 0.0)
    w = max(t1 - m1 * c, 0.0)
    return c, w, f"a forward's micro-batch costs {1000 * c:.3g} ms beside {w:.3g} s of token work, fitted from the stages"


def rows_per_rank(f: Facts) -> int:
    """The samples one rank's log-prob forwards read per step (micro_batches' rows over the ranks); 0 when unknown."""
    s, n = f.settings, f.settings.get("actor_rollout_ref.rollout.n", 1)
    rows = ((s.get("actor_rollout_ref.actor.ppo_mini_batch_size") or 0) * s.get("async_training.require_batches", 1) * n
            if run_mode(f).streams else s.get("data.train_batch_size", 0) * n)
    return math.ceil(rows / world_size(f))


def micro_batches(f: Facts, micro: Optional[int] = None) -> Optional[tuple[int, int, int]]:
    """(update micro-batches per epoch with `micro` samples each (None: the run's), old_log_prob's forward
    micro-batches, mini-batches per epoch), on one rank; None when the settings lack them."""
    s = f.settings
    mini, n = s.get("actor_rollout_ref.actor.ppo_mini_batch_size"), s.get("actor_rollout_ref.rollout.n", 1)
    micro = micro or s.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    rows = update_rows(f)
    if not (mini and micro and rows):
        return None
    world, per_mini = world_size(f), mini * n
    minis = math.ceil(rows / per_mini)
    log_prob = s.get("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu") or rows  # null: one forward
    return (minis * math.ceil(math.ceil(per_mini / world) / micro), math.ceil(math.ceil(rows / world) / log_prob), minis)


def micro_batch_fit(f: Facts, k: float, k_new: float, m: int) -> tuple[float, str]:
    """The update's seconds with `k_new` micro-batches per epoch instead of `k`. A forward over the batch
    costs m·c + W with m micro-batches (c: a micro-batch's fixed cost, W: the batch's token work), a
    training pass three forwards (UPDATE_OVER_FORWARD): two equations, update_actor at k and
    old_log_prob at m, give c and W, and the update becomes epochs·3·(k_new·c + W). Without an
    old_log_prob pass (fused) or with k <= m the split is unknown: the bound is then the update with every
    micro-batch's cost fixed (k_new / k of it), the most a larger micro-batch can save."""
    update, olp = f.trainer_s.get("update_actor", 0.0), f.trainer_s.get("old_log_prob", 0.0)
    epochs = f.settings.get("actor_rollout_ref.actor.ppo_epochs", 1)
    per_forward = update / (UPDATE_OVER_FORWARD * epochs)
    if not olp or k <= m:
        return update * k_new / k, (f"{k_new:.0f} micro-batches per epoch instead of {k:.0f}, each taken as fixed cost "
                                    "(no old_log_prob pass to split fixed cost from token work): the most it can save")
    c = max((per_forward - olp) / (k - m), 0.0)
    w = max(olp - m * c, 0.0)
    bound = UPDATE_OVER_FORWARD * epochs * (k_new * c + w)
    return min(bound, update), (f"{k_new:.0f} micro-batches per epoch instead of {k:.0f}: each costs {1000 * c:.3g} ms "
                                f"beside {w:.3g} s of token work per pass, fitted from update_actor and old_log_prob "
                                f"({m} micro-batch{'es' if m > 1 else ''}); a training pass is {UPDATE_OVER_FORWARD:g} forwards")


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.0f} %"


def _token_budgets(f: Facts) -> float:
    """With use_dynamic_bsz: the real tokens of one optimizer step over the token budget per micro-batch."""
    s, per_step = f.settings, responses_per_step(f)
    budget, tokens = s.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), f.metrics.get("global_seqlen/real_tokens")
    mini = s.get("actor_rollout_ref.actor.ppo_mini_batch_size", 0) * s.get("actor_rollout_ref.rollout.n", 1)
    return tokens * mini / per_step / budget if budget and tokens and per_step else 0.0


def _headroom(f: Facts) -> Optional[float]:
    """The free share of the device's memory at the run's peak; None when unknown."""
    cap, peak = f.settings.get("memory_capacity_gb"), f.memory_peak
    return 1 - peak["gb"] / cap if cap and peak else None


MEMORY_KEYS = {"update_actor": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",   # stage -> the key whose
               "old_log_prob": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",  # half lowers its peak
               "ref": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
               "update_critic": "critic.ppo_micro_batch_size_per_gpu",
               "gen": "actor_rollout_ref.rollout.max_num_seqs"}


def memory_full(f: Facts) -> Optional[Verdict]:
    """A stage's peak >= MEMORY_FULL of the device: half the key that sets how many samples it holds."""
    cap, peak = f.settings.get("memory_capacity_gb"), f.memory_peak
    if not cap or not peak or peak["gb"] / cap < MEMORY_FULL or peak["stage"] not in MEMORY_KEYS:
        return None
    key = MEMORY_KEYS[peak["stage"]]
    now = f.settings.get(key) or responses_per_step(f)  # null micro-batch: the whole batch at once
    if not now:
        return None
    return Verdict("memory_full", f"memory in {peak['stage']}", peak["gb"] / cap, "of the device's memory at its peak",
                   f"the stage's peak {peak['gb']:.3g} GB of {cap:.3g} GB at step {peak['step']} ({peak['metric']})",
                   key, max(1, now // 2),
                   f"{peak['stage']}'s peak lower (half the samples at once); an out-of-memory less likely",
                   0.0, [f"{peak['metric']} {peak['gb']:.3g} GB", f"capacity {cap:.3g} GB"],
                   {"peak_gb": peak["gb"], "capacity_gb": cap, "stage": peak["stage"]}, {})


def overhead(f: Facts) -> list[Verdict]:
    """Validation or checkpoints >= OVERHEAD_SHARE of the wall time after start-up."""
    w, s = f.wall, f.settings
    total = w.get("total", 0.0) - w.get("startup", 0.0)
    out = []
    for part in ("validation", "checkpoints"):  # the profiler's own cost is profiler_line's
        spent = w.get(part, 0.0)
        if total <= 0 or spent / total < OVERHEAD_SHARE:
            continue
        target = OVERHEAD_TARGET / (1 - OVERHEAD_TARGET) * (total - spent)  # seconds that would make it ~10 %
        fix = _overhead_fix(part, s, spent, target)
        if fix is None:
            continue
        key, value, driver, after, how = fix
        out.append(Verdict(f"{part}_share", part, spent / total, WALL, driver, key, value,
                           f"{part} about {after:.3g} s instead of {spent:.3g} s ({how})", (spent - after) / total,
                           [f"{part} {spent:.3g} s of {total:.3g} s", f"steps {w.get('steps', 0.0):.3g} s", driver],
                           {"spent_s": spent, "wall_s": total, "now": s.get(key)}, {"spent_s": after}))
    return out


TOKEN_END_SUGGESTED = 32  # decode steps per generate kept in the rollout's trace
FREQ = {"validation": "trainer.test_freq", "checkpoints": "trainer.save_freq"}


def _overhead_fix(part: str, s: dict, spent: float, target: float) -> Optional[tuple]:
    """(key, value, what drives it, seconds after, how) or None when no setting would help."""
    if part == "profiler":
        steps = s.get("global_profiler.steps") or []
        if len(steps) > 1:
            return ("global_profiler.steps", [steps[0]], f"{len(steps)} profiled windows ({s.get('global_profiler.tool')})",
                    spent / len(steps), "one window")
        if (s.get("actor_rollout_ref.rollout.profiler.enable") and s.get(TOKEN_END) is None
                and s.get("data.max_response_length", TOKEN_END_SUGGESTED + 1) > TOKEN_END_SUGGESTED):  # else it bounds nothing
            return (TOKEN_END, TOKEN_END_SUGGESTED, "the rollout's trace of every decode step", min(spent, target),
                    "32 decode steps per generate in the trace: docs/profiling.md measured 268.7 s to 5.6 s on vLLM")
        return None
    freq = s.get(FREQ[part])
    if not isinstance(freq, int) or freq <= 0:
        return None
    new = max(freq + 1, math.ceil(freq * spent / max(target, 1e-9)))
    return FREQ[part], new, f"{part} every {freq} step(s) ({FREQ[part]}={freq})", spent * freq / new, f"every {new} steps"


def profiler_line(f: Facts) -> Optional[dict]:
    """The profiler's own cost, a line of its own and never a verdict (profiling a run must not change
    what it is told): its windows, the seconds starting them and stopping and writing them (the finish
    hook too), their share of the wall time, how much slower a step ran inside a window, which steps the
    verdict read, and, at OVERHEAD_SHARE of the wall time or more, the key that spends less."""
    p, w, s = f.profiler, f.wall, f.settings
    if not p.get("windows"):
        return None
    spent = p["total_s"] or w.get("profiler", 0.0)
    total = w.get("total", 0.0) - w.get("startup", 0.0)
    parts = f"starting {p['start_s']:.3g} s, stopping and writing {p['stop_s']:.3g} s" + (
        f", finish hook {p['hook_s']:.3g} s" if p["hook_s"] else "")
    line = f"profiler: {p['windows']} window{'s' if p['windows'] > 1 else ''} cost {spent:.3g} s ({parts})"
    if total > 0:
        line += f", {_pct(min(spent / total, 1.0))} of the run's wall time after start-up"
    if p["slowdown"]:
        line += f"; a profiled step's own time was {p['slowdown']:.2f}x an unprofiled one's"
    elif p.get("unsaid"):
        line += f"; how much slower a profiled step ran is not said: {p['unsaid']}"
    line += f"; the verdict reads the {f.basis}"
    out = {**p, "spent_s": spent, "key": "", "value": None, "predicted": {}}
    if total > 0 and spent / total >= OVERHEAD_SHARE:
        fix = _overhead_fix("profiler", s, spent, OVERHEAD_TARGET / (1 - OVERHEAD_TARGET) * (total - spent))
        if fix is not None:
            key, value, _, after, how = fix
            line += f"; to spend less: try {key}={_value(value)} (expected: about {after:.3g} s; {how})"
            out.update(key=key, value=value, predicted={"spent_s": after})
    return {**out, "line": line}


STRAGGLER = 1.5  # a rank whose own work in a stage (waits left out) is >= 1.5x the median rank's


def straggler(f: Facts) -> Optional[Verdict]:
    """A data-parallel rank much slower than the others in a stage (from the workers' own spans, Ray):
    the others wait for it in the stage's collectives. The step could lose the slow rank's excess."""
    found = []
    for name, ranks in f.ranks.items():
        work = {r: max(v["s"] - v["wait_s"], 0.0) for r, v in ranks.items()}
        median = sorted(work.values())[(len(work) - 1) // 2]
        slow = max(work, key=work.get)
        if median > 0 and work[slow] / median >= STRAGGLER and f.step_s:
            found.append((work[slow] - median, name, slow, work, median))
    if not found:
        return None
    excess, name, slow, work, median = max(found)
    role, stage = name.split("/", 1)
    waits = statistics.median(v["wait_s"] for r, v in f.ranks[name].items() if r != slow)
    return Verdict("straggler", f"{role} rank {slow} in {stage}", work[slow] / f.step_s, _of_step(f),
                   f"its own work {work[slow]:.3g} s is {work[slow] / median:.1f}x the median rank's ({median:.3g} s); "
                   f"the other ranks wait {waits:.3g} s in collectives (all-reduce, all-gather)", "", None,
                   f"step about {f.step_s - excess:.3g} s instead of {f.step_s:.3g} s if rank {slow} worked as fast as "
                   "the others", excess / f.step_s,
                   [f"{role} rank {r}: {v['s']:.3g} s in {stage}, {v['wait_s']:.3g} s of it waiting"
                    for r, v in f.ranks[name].items()],
                   {"ranks": {str(r): v for r, v in f.ranks[name].items()}, "step_s": f.step_s},
                   {"step_s": f.step_s - excess},
                   advice=f"no key: look at {role} rank {slow}'s process (its node, its share of the data, what "
                          "else runs there)")


def unattributed(f: Facts) -> Optional[Verdict]:
    """Time no span names >= HOLE_SHARE of the step: the verdicts above cannot see into it."""
    share = f.trainer.get(UNATTRIBUTED, 0.0)
    if share < HOLE_SHARE:
        return None
    return Verdict("unattributed", "unattributed (no span)", share, _of_step(f),
                   "trainer time between spans that no span names", "", None,
                   "a span that names it; until then every other share here is of a step partly unexplained",
                   share, [f"unattributed {f.trainer_s.get(UNATTRIBUTED, 0.0):.3g} s of a {f.step_s:.3g} s step"],
                   {"unattributed_s": f.trainer_s.get(UNATTRIBUTED, 0.0), "step_s": f.step_s}, {})


RULES: list[Callable[[Facts], Any]] = [generation_bound, async_idle, response_tail, reward_bound, judge_bound, weight_sync,
                                       update_cost, log_prob_cost, old_log_prob_bypass, straggler, memory_full, overhead,
                                       unattributed]


def verdicts(f: Facts, top: int = 3, skipped: Optional[list[str]] = None) -> list[Verdict]:
    """The rules' verdicts that stand out, one per key, ranked by what they could save. A rule that
    cannot read the records (a summary.json edited by hand, from another version) is left out and
    named in `skipped`; the others still speak."""
    found = []
    for rule in RULES:
        try:
            got = rule(f)
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as err:
            (skipped if skipped is not None else []).append(f"{rule.__name__}: {type(err).__name__}: {err}")
            continue
        found += got if isinstance(got, list) else [got] if got else []
    for v in found:  # one place for the rule of rules: a key that does nothing on this run, asks for more of the
        # machine than it has, or would fill the device's memory, is not suggested
        why = next(filter(None, (no_effect_here(k, f.settings) for k in v.overrides())), None) or \
            (cannot_carry(v.overrides(), f.settings) if v.key else None) or (attach(v, f) if v.key else None)
        if why:
            v.advice = f"{' '.join(v.overrides())} would be the lever, but {why}"
            v.key, v.value, v.also = "", None, {}
    keep = [v for v in found if v.saving >= MIN_SAVING or v.rule == "memory_full"]
    keep.sort(key=lambda v: -v.saving)
    out, keys = [], set()
    for v in keep:
        if v.key not in keys or not v.key:
            out.append(v)
            keys.add(v.key)
    return out[:top]


def no_effect_here(key: str, s: dict[str, Any]) -> Optional[str]:
    """Why `key` does nothing on this run's backend, device and rollout engine, from the tables plait
    names such keys by at start (config_verl's, the engines'); None when it acts or the records do not
    say the backend, device or engine (a summary.json from before they were recorded)."""
    from plait.config_verl import CPU_NO_EFFECT, CPU_RAY_NO_EFFECT, LOCAL_BACKEND_NO_EFFECT
    from plait.workers.engine import ENGINES
    backend, device, engine = s.get("trainer.backend"), s.get("device"), s.get("actor_rollout_ref.rollout.name")
    if backend == "local" and key in LOCAL_BACKEND_NO_EFFECT:
        return f"it has no effect on the local backend ({LOCAL_BACKEND_NO_EFFECT[key]})"
    if device == "cpu" and key in {**CPU_NO_EFFECT, **(CPU_RAY_NO_EFFECT if backend == "ray" else {})}:
        return f"it has no effect without CUDA ({({**CPU_NO_EFFECT, **CPU_RAY_NO_EFFECT})[key]})"
    if engine in ENGINES and key in ENGINES[engine].no_effect:
        return f"it has no effect with rollout.name={engine} ({ENGINES[engine].no_effect[key]})"
    return None


def devices_needed(s: dict[str, Any]) -> Optional[tuple[str, float]]:
    """(resource, amount) the Ray backend asks of one machine for settings `s`: its trainer ranks' CPUs (or
    GPUs) and a separated rollout's own (backends/ray.py's pools); None off Ray or when the device is unknown."""
    if s.get("trainer.backend") != "ray" or s.get("device") not in ("cpu", "cuda"):
        return None
    cpus, slots = s.get("trainer.ray.cpus_per_worker", 1.0), s.get("actor_rollout_ref.rollout.n_gpus_per_node", 1)
    rollout = slots if s.get("trainer.placement") == "separated" else 0
    if s["device"] == "cpu":
        return "CPUs", cpus * (s.get("trainer.ray.num_cpu_workers", 1) + rollout)
    return "GPUs", s.get("trainer.nnodes", 1) * s.get("trainer.n_gpus_per_node", 1) + rollout


def cannot_carry(overrides: dict[str, Any], s: dict[str, Any]) -> Optional[str]:
    """Why this machine cannot run the run's settings with `overrides` applied (Ray would refuse them: more CPUs
    or GPUs than the machine has, `cpus` and `gpus` in the settings); None when it can or the records do not say."""
    need = devices_needed({**s, **overrides})
    if need is None or s.get(need[0].lower()) is None or s.get("trainer.nnodes", 1) > 1:  # a cluster: not this machine
        return None
    resource, amount = need
    have = s[resource.lower()]
    return None if amount <= have else f"it needs {amount:g} {resource} and this machine has {have}"


def settings_of(flat_config: dict[str, Any], memory_capacity_gb: Optional[float], device: Optional[str] = None) -> dict[str, Any]:
    """summary.json's `settings`: the SETTINGS keys of the run's flattened config, the device's memory and
    kind ("cpu", "cuda": which keys act here), and the machine's CPUs (Ray's, when set) and GPUs (what it can carry)."""
    import os
    gpus = 0
    if device == "cuda":
        import torch
        gpus = torch.cuda.device_count()
    return {**{k: flat_config[k] for k in SETTINGS if k in flat_config}, "memory_capacity_gb": memory_capacity_gb,
            "device": device, "cpus": flat_config.get("trainer.ray.num_cpus") or os.cpu_count(), "gpus": gpus}


def of_run(spans: list[dict], metrics: list[dict], summary: Optional[dict]) -> Facts:
    """Facts from a run's timeline spans, its step records and its summary.json (or None)."""
    from plait.profiler.analysis.accounting import account
    return facts(account(spans), [m for m in metrics if m.get("step", 0) >= 1], summary, spans)


SCHEMA = 1  # verdict.json's version (docs/profiling.md): raised when a field changes meaning or goes away


def report(f: Facts, alarms: Optional[list[dict]] = None) -> dict:
    """verdict.json: the run's health alarms first (alarms.py), then the verdicts (each marked with the caveat
    while an alarm holds), and every rule's facts (so a reader can redo the numbers)."""
    skipped: list[str] = []
    caveat = {"caveat": CAVEAT} if alarms else {}
    return {"schema": SCHEMA, "alarms": alarms or [],
            "verdicts": [{**v.as_dict(), **caveat} for v in verdicts(f, skipped=skipped)], "skipped_rules": skipped,
            "profiler": profiler_line(f),
            "facts": asdict(f),
            "thresholds": {k: v for k, v in globals().items() if k.isupper() and type(v) in (int, float) and k != "SCHEMA"}}
