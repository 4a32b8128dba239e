"""Health alarms: what is wrong with a run, said before any advice on what is slow (verdict.py).

    timeline.jsonl spans ──────────────────┐
    metrics.jsonl records (finite numbers, ┼─▶ each rule in RULES ─▶ alarms() ─▶ [Alarm]
      and the "nan"/"inf" plait writes)    │   (pure, one small function each)
    summary.json settings ─────────────────┘
    ─▶ verdict.json "alarms" · the console's verdict lines (first) · the report page (first) · the live report

A rule is a pure function of (spans, records, settings) returning a list of Alarms, each naming the step it
first held at, the stage or rank where it has one, the numbers it rests on and the config key to look at:

    stall        a stage's span >= STALL_RATIO x the median of its (role, stage, rank) and >= STALL_S (its
                 first span, a warm-up, excepted)
    no_signal    median share of prompt groups whose every response has zero advantage (all rewards equal)
                 >= NO_SIGNAL: GRPO learns nothing from them (training/no_signal_group_ratio)
    truncation   median share of responses cut at data.max_response_length >= TRUNCATED
    engine       a rollout engine restarted (rollout/engine_restarts), or >= ABORTED of a step's responses
                 empty (response/aborted_ratio)
    failures     >= FAILED of a step's agent sessions failed, or rollouts evicted as failed
    non_finite   a loss or grad norm that is NaN or infinite
    exploding    a grad norm >= EXPLODING x the median of the (last EXPLODING_WINDOW) steps before it
    waste        median share of a step's generated tokens discarded (the token ledger, tokens/discarded/<cause>)
                 >= WASTED: the largest cause named with its key

While an alarm holds, the verdict's tuning advice may mislead (a stalled or signal-less run is not slow for
the reasons the speed rules read), and every reader says so. The thresholds are the constants below, set so
that a healthy run (the demo model warm-started: tests/profiler/test_alarms.py) raises none.
What is left out: a stage still open (the timeline holds a span once it ends, so a hang is seen after it ends,
or in the live report once the stage closes); samples.jsonl (the step's metrics carry the shares).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from plait.profiler.timeline import COLLECTIVES

STALL_RATIO = 10.0   # a span >= 10x the median span of its stage ...
STALL_S = 10.0       # ... and >= 10 s
STALL_MIN_SPANS = 3  # a median needs at least three spans of the stage
NO_SIGNAL = 0.90     # median share of groups with zero advantage
TRUNCATED = 0.20     # median share of responses cut at the length limit
ABORTED = 0.10       # share of a step's responses aborted (empty)
FAILED = 0.10        # share of a step's agent sessions that failed
EXPLODING = 10.0     # a grad norm >= 10x the median of the earlier steps' ...
EXPLODING_AFTER = 3  # ... once there are at least three of them ...
EXPLODING_WINDOW = 20  # ... the last 20 (a long run's scale drifts; and a median over all of them is quadratic)
WASTED = 0.30        # median share of a step's generated tokens discarded
MAX_EVIDENCE = 8      # evidence lines kept per alarm
NONFINITE = ("nan", "inf", "-inf")  # how metrics.jsonl holds a non-finite number (tracking.as_record)
# once-only, or containers of other stages; waits ("wait_*", a rank's collectives) are where another stage's or
# rank's stall shows, not a stall of their own
NOT_STALLS = ("step", "testing", "save_checkpoint", "profiler_start", "profiler_stop", "finish_hook", *COLLECTIVES)
STALL_KEYS = {"reward": "reward.custom_reward_function.timeout"}
CAVEAT = "advice while an alarm holds may mislead: fix the alarms first"
WASTE_KEYS = {  # the token ledger's causes (trainers/metrics.py TokenLedger): the key that acts on each, and how
    "stale": ("trainer.v1.sampler.max_off_policy_threshold", "raise it, or set max_off_policy_strategy=wait: groups "
              "evicted as stale are generated again, and evicting them again and again leaves the easy prompts"),
    "filtered": ("algorithm.filter_groups.enable", "the dropped groups had equal rewards: data nearer the policy's "
                 "difficulty wastes less (or drop the filter and accept their zero advantage)"),
    "rejected": ("algorithm.rollout_correction.rollout_rs", "its rejection (or failed agent sessions) masked them out "
                 "of the loss: loosen the threshold, or read the failures the run printed"),
}


@dataclass
class Alarm:
    rule: str
    step: int                  # the first step it held at
    what: str                  # what holds, one clause
    key: str                   # the config key to look at ("" when no key acts on it)
    fix: str                   # what to do with the key (or, without one, where to look)
    stage: Optional[str] = None
    rank: Optional[int] = None  # a worker's rank (Ray spans); None: the driver's own spans
    evidence: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.evidence = self.evidence[:MAX_EVIDENCE]  # a long run's steps: the first few, the clause says how many

    def line(self) -> str:
        return f"{self.rule} at step {self.step}: {self.what}; " + (f"key {self.key}: {self.fix}" if self.key
                                                                    else self.fix)

    def as_dict(self) -> dict:
        return {**asdict(self), "line": self.line()}


def alarms(spans: list[dict], records: list[dict], settings: Optional[dict] = None) -> list[Alarm]:
    """Every rule's alarms, in the order of RULES (a run's worst problems first)."""
    records = sorted((r for r in records if isinstance(r.get("step"), int) and r["step"] >= 1), key=lambda r: r["step"])
    return [a for rule in RULES for a in rule(spans, records, settings or {})]


def console_lines(found: list[dict], advice: bool) -> list[str]:
    """The console's alarm lines (verdict.json's dicts), said before the verdict's; then the caveat on its
    advice, when there is some."""
    return [f"alarm: {a['line']}" for a in found] + ([f"  {CAVEAT}"] if found and advice else [])


# -- the rules ----------------------------------------------------------------------------------

def stall(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """The longest span of each (role, stage, rank) that ran >= STALL_RATIO x the stage's median and >= STALL_S.
    Its first span is not a candidate: a first call warms up (compiles, loads weights, fills caches)."""
    by_stage: dict[tuple, list[dict]] = {}
    for s in spans:
        if s["stage"] not in NOT_STALLS and not s["stage"].startswith("wait"):
            by_stage.setdefault((s["role"], s["stage"], s.get("rank")), []).append(s)
    out = []
    for (role, stage, rank), group in by_stage.items():
        if len(group) < STALL_MIN_SPANS:
            continue
        median = statistics.median(s["end"] - s["start"] for s in group)
        worst = max(sorted(group, key=lambda s: s["start"])[1:], key=lambda s: s["end"] - s["start"])
        took = worst["end"] - worst["start"]
        if took >= STALL_S and took >= STALL_RATIO * median:
            where = f"{role} {stage}" + (f" on rank {rank}" if rank is not None else "")
            key = STALL_KEYS.get(stage, "")
            step = worst["step"]
            fix = ("it bounds one call; " if key else "") + f"look at what {stage} waited on in step {step}'s Gantt"
            out.append(Alarm("stall", step, f"{where} was open {took:.3g} s, {took / max(median, 1e-9):.0f}x its median "
                             f"{median:.3g} s", key, fix, stage, rank,
                             [f"{where}: {len(group)} spans, median {median:.3g} s, longest {took:.3g} s at step {step}"]))
    return out


def no_signal(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """Most prompt groups' responses all got one reward: their advantages are zero and the update learns nothing."""
    got = _share("training/no_signal_group_ratio", records, NO_SIGNAL)
    if got is None:
        return []
    median, first, n = got
    return [Alarm("no_signal", first, f"{_pct(median)} of prompt groups had zero advantage (every response's reward "
                  f"equal), median over {n} steps", "algorithm.filter_groups.enable",
                  "set it true to drop such groups; or use data of the policy's difficulty (a reward that is always the "
                  "same teaches nothing)",
                  evidence=[f"training/no_signal_group_ratio median {median:.3g} (>= {NO_SIGNAL:g}), first at step "
                            f"{first}"])]


def truncation(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """Many responses end at the length limit: their rewards read cut-off answers."""
    got = _share("response_length/clip_ratio", records, TRUNCATED)
    if got is None:
        return []
    median, first, n = got
    limit = settings.get("data.max_response_length")
    now = f"data.max_response_length={limit}" if limit else "data.max_response_length"
    return [Alarm("truncation", first, f"{_pct(median)} of responses were cut at {now}, median over {n} steps",
                  "data.max_response_length", "raise it (or reward shorter answers)",
                  evidence=[f"response_length/clip_ratio median {median:.3g} (>= {TRUNCATED:g}), first at step {first}"])]


def engine(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """A rollout engine that died and was restarted, or aborted many of a step's responses."""
    out = []
    restarts = _steps(records, "rollout/engine_restarts", 1)
    if restarts:
        total = sum(n for _, n in restarts)
        out.append(Alarm("engine_restarts", restarts[0][0], f"the rollout engine was restarted {total:.0f} time(s)",
                         "", "look at the engine's log at those steps (an out-of-memory, a crash)", stage="gen",
                         evidence=[f"rollout/engine_restarts {n:g} at step {s}" for s, n in restarts]))
    aborted = _steps(records, "response/aborted_ratio", ABORTED)
    if aborted:
        out.append(Alarm("engine_aborts", aborted[0][0], f"{_pct(max(v for _, v in aborted))} of a step's responses "
                         f"were aborted (empty) in {len(aborted)} step(s)", "",
                         "look at what aborted them (the engine's log, a weight sync cutting generation short)",
                         stage="gen", evidence=[f"response/aborted_ratio {v:.3g} at step {s}" for s, v in aborted]))
    return out


def failures(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """Agent sessions that failed (each masked out of the loss), rollouts evicted as failed."""
    out = []
    failed = [(r["step"], r["agent/failed_sessions"], r["agent/sessions"]) for r in records
              if _num(r.get("agent/sessions")) > 0 and _num(r.get("agent/failed_sessions")) >= FAILED * r["agent/sessions"]]
    if failed:
        out.append(Alarm("failed_sessions", failed[0][0], f"agent sessions failed in {len(failed)} step(s) (at most "
                         f"{_pct(max(f / n for _, f, n in failed))} of a step's)",
                         "actor_rollout_ref.rollout.agent.openai_agent.timeout",
                         "a session running past it fails; read the failures the run printed (one line per step)",
                         stage="agent", evidence=[f"agent/failed_sessions {f:g} of {n:g} at step {s}" for s, f, n in failed]))
    evicted = _steps(records, "training/rollout_failure/evicted_samples", 1)
    if evicted:
        out.append(Alarm("failed_rollouts", evicted[0][0], f"{sum(n for _, n in evicted):.0f} rollouts were evicted as "
                         "failed", "", "look at the rollout's errors in the run's log", stage="gen",
                         evidence=[f"training/rollout_failure/evicted_samples {n:g} at step {s}" for s, n in evicted]))
    return out


def non_finite(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """A loss or grad norm that is NaN or infinite (the actor skips such an optimizer step; the run goes on blind)."""
    bad = [(r["step"], k, v) for r in records for k, v in r.items() if _trained(k) and _is_nonfinite(v)]
    if not bad:
        return []
    step, key, value = bad[0]
    role = _role(key)
    return [Alarm("non_finite", step, f"{key} was {value}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                  f"{role}.optim.lr", f"lower it, or look at the rewards and advantages of step {step}",
                  evidence=[f"{k} {v} at step {s}" for s, k, v in bad])]


def exploding(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """A grad norm that jumps to >= EXPLODING x the median of the steps before it."""
    out = []
    keys = sorted({k for r in records for k in r if k.endswith("grad_norm")})
    for key in keys:
        seen: list[float] = []
        for r in records:
            v = r.get(key)
            if not _finite(v):
                continue
            median = statistics.median(seen[-EXPLODING_WINDOW:]) if len(seen) >= EXPLODING_AFTER else 0.0
            if median > 0 and v >= EXPLODING * median:
                role = _role(key)
                out.append(Alarm("exploding", r["step"], f"{key} {v:.3g} is {v / median:.0f}x its median {median:.3g} over "
                                 f"the steps before", f"{role}.optim.lr",
                                 f"lower it ({role}.grad_clip bounds each update, not the norm)",
                                 evidence=[f"{key} {v:.3g} at step {r['step']}; median {median:.3g} over the "
                                           f"{min(len(seen), EXPLODING_WINDOW)} nonzero steps before"]))
                break
            if v > 0:  # a step without signal has a zero norm: it says nothing about the scale
                seen.append(v)
    return out


def waste(spans: list[dict], records: list[dict], settings: dict) -> list[Alarm]:
    """Much of what the rollout generated was thrown away (the token ledger): name the largest cause and its key."""
    shares = [(r["step"], r["tokens/discarded"] / r["tokens/generated"]) for r in records
              if _num(r.get("tokens/generated")) > 0 and _finite(r.get("tokens/discarded"))]
    if not shares or statistics.median(v for _, v in shares) < WASTED:
        return []
    median = statistics.median(v for _, v in shares)
    by_cause = {c: sum(_num(r.get(f"tokens/discarded/{c}")) for r in records) for c in WASTE_KEYS}
    cause = max(by_cause, key=by_cause.get)
    key, fix = WASTE_KEYS[cause]
    first = next(s for s, v in shares if v >= WASTED)
    total = sum(by_cause.values())
    return [Alarm("waste", first, f"{_pct(median)} of the generated tokens were discarded (median over {len(shares)} "
                  f"steps), most as {cause} ({_pct(by_cause[cause] / total if total else 0)} of the waste)", key, fix,
                  evidence=[f"tokens/discarded/{c} {n:.0f} in all" for c, n in by_cause.items() if n]
                  + [f"tokens/discarded / tokens/generated median {median:.3g} (>= {WASTED:g}), first at step {first}"])]


RULES = [stall, non_finite, exploding, engine, failures, waste, no_signal, truncation]


# -- helpers ------------------------------------------------------------------------------------

def _share(key: str, records: list[dict], threshold: float) -> Optional[tuple[float, int, int]]:
    """(median over the steps, first step at or above `threshold`, steps) of a per-step share; None when
    the median is below it or no step records it."""
    values = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
    if not values:
        return None
    median = statistics.median(v for _, v in values)
    if median < threshold:
        return None
    return median, next(s for s, v in values if v >= threshold), len(values)


def _steps(records: list[dict], key: str, at_least: float) -> list[tuple[int, float]]:
    """(step, value) of the steps whose `key` is >= `at_least`."""
    return [(r["step"], r[key]) for r in records if _num(r.get(key)) >= at_least]


def _trained(key: str) -> bool:
    """A loss or grad norm of a trained role (actor/pg_loss, critic/vf_loss, actor/grad_norm, ...)."""
    name = key.rsplit("/", 1)[-1]
    return key.split("/", 1)[0] in ("actor", "critic") and ("loss" in name or name == "grad_norm")


def _role(key: str) -> str:
    return "critic" if key.startswith("critic/") else "actor_rollout_ref.actor"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> float:
    return v if _finite(v) else 0.0


def _is_nonfinite(v: Any) -> bool:
    return v in NONFINITE or (isinstance(v, float) and not math.isfinite(v))


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"
