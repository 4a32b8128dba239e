"""The verdict for a served Tinker session (plait serve's timeline): is the time in the server's jobs or in the
client's loop between them, and which loop pattern costs it.

    timeline.jsonl (role tinker: a `queue` span and the job's own per request, "session" SESSION:...) ─▶
        sessions(spans) ─▶ Session per SDK session ─▶ each rule in RULES ─▶ verdicts()

A Tinker loop is the user's code: there are no config keys to suggest, so each verdict says what to change in
the loop (`advice`) and the most it can save, as a share of the session's wall time (its first request's
arrival to its last job's end). The rules:
- `loop_between_requests`: none of the session's requests was at the server (queued or running) for >= IDLE_SHARE
  of its time: the time went to the client (its own code between requests: rewards, building data) and the SDK's
  round trips.
- `samples_one_by_one`: a sampler's sample requests ran as separate engine calls, each sent only after the one
  before had ended (the loop awaited each result before sending the next): submitted together they share one
  engine batch. The saving is the calls' time beyond the longest one (the bound one batch approaches).
- `sampler_switches`: the engine loaded samplers' weights more often than there are samplers (two samplers
  sampled in turn reload each other) for >= MIN_SAVING of the session.
Left out: a prediction `plait profile diff` measures in a rerun (a server has no steps to compare), request
sizes (the timeline has no datum counts), several sessions competing for the one worker (their `queue` spans
show it in the report's table).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from plait.profiler.analysis.verdict import MIN_SAVING, Verdict
from plait.profiler.timeline import union_of

IDLE_SHARE = 0.30  # the server idle >= 30 % of a session's wall time: the loop between requests bounds it
SERIAL_CALLS = 3   # a sampler's engine calls awaited one by one: at least this many before it is said


@dataclass
class Session:
    """One SDK session's requests on the server's timeline."""
    id: str
    start: float                      # its first request's arrival
    end: float                        # its last job's end
    busy_s: float                     # time with one of its jobs running (overlaps counted once)
    requests: int
    optim_steps: int
    idle_gaps: list[tuple[float, str]] = field(default_factory=list)  # none of its requests at the server (queued
    #                                                                   or running): (seconds, the job before)
    serial: dict[str, list[float]] = field(default_factory=dict)  # sampler -> its engine calls awaited one by one
    loads: int = 0                    # load_weights spans (the engine taking a sampler's weights)
    load_s: float = 0.0
    samplers: int = 0                 # samplers that sampled

    @property
    def wall_s(self) -> float:
        return max(self.end - self.start, 1e-9)


def sessions(spans: list[dict]) -> list[Session]:
    """The served sessions on a timeline (spans with a "session": SESSION:train:N or SESSION:...:sample:N)."""
    by_session: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        if s.get("session") is not None and s.get("role") == "tinker":
            by_session[str(s["session"]).split(":")[0]].append(s)
    return [_session(sid, group) for sid, group in by_session.items()
            if any(s["stage"] not in ("queue", "load_weights") for s in group)]  # a job ran (a crafted file may lack one)


def _session(sid: str, spans: list[dict]) -> Session:
    queued = {(s["session"], s["end"]): s["start"] for s in spans if s["stage"] == "queue"}  # a job's arrival
    jobs = [s for s in spans if s["stage"] not in ("queue", "load_weights")]  # a load runs inside its sample
    busy = sum(end - begin for begin, end in union_of([(s["start"], s["end"]) for s in jobs]))
    at_server = union_of([(s["start"], s["end"]) for s in spans])  # waiting in the queue is time at the server too
    ended = {s["end"]: s["stage"] for s in sorted(jobs, key=lambda s: s["start"])}  # the job that ends a stretch
    idle = [(begin - end, ended.get(end, "queue")) for (_, end), (begin, _) in zip(at_server, at_server[1:])]
    start = min([*queued.values(), *(s["start"] for s in jobs)])
    units: dict[tuple, _Unit] = {}  # the session's jobs in start order; requests sampled in one engine call: one
    for s in sorted(jobs, key=lambda s: s["start"]):
        key = (s["session"], s["start"], s["end"]) if s["stage"] == "sample" else (id(s),)
        unit = units.setdefault(key, _Unit(s["stage"], s["session"], s["start"], s["end"], s["start"]))
        unit.arrival = min(unit.arrival, queued.get((s["session"], s["start"]), s["start"]))
    ordered, awaited = list(units.values()), set()
    for i, (prev, cur) in enumerate(zip(ordered, ordered[1:])):
        if prev.stage == cur.stage == "sample" and prev.client == cur.client and cur.arrival >= prev.end:
            awaited |= {i, i + 1}  # sent only once the call before it had ended
    serial: dict[str, list[float]] = defaultdict(list)
    for i in sorted(awaited):
        serial[ordered[i].client].append(ordered[i].end - ordered[i].start)
    loads = [s for s in spans if s["stage"] == "load_weights"]
    return Session(sid, start, max(s["end"] for s in jobs), busy, len(jobs),
                   sum(s["stage"] == "optim_step" for s in jobs), idle, dict(serial), len(loads),
                   sum(s["end"] - s["start"] for s in loads), len({s["session"] for s in jobs if s["stage"] == "sample"}))


@dataclass
class _Unit:
    """A job on the server, or one engine call of several sample requests."""
    stage: str
    client: str
    start: float
    end: float
    arrival: float  # its (first) request's arrival


def loop_between_requests(s: Session) -> Verdict | None:
    idle = sum(gap for gap, _ in s.idle_gaps)
    share = idle / s.wall_s
    if share < IDLE_SHARE:
        return None
    per_step = f", {s.requests / s.optim_steps:.3g} per optim_step" if s.optim_steps else ""
    longest, after = max(s.idle_gaps)
    return Verdict(
        "loop_between_requests", "the client loop between requests", share, _basis(s),
        f"{s.requests} requests{per_step}; the server idle {len(s.idle_gaps)} times, a median "
        f"{1000 * statistics.median(g for g, _ in s.idle_gaps):.3g} ms, the longest {longest:.3g} s (after a {after})",
        "", None, "up to the idle share: the loop's own code (rewards, data) and the SDK's round trips (~1-3 ms a "
        "request)", share, [f"server busy {s.busy_s:.3g} s of {s.wall_s:.3g} s", f"idle {idle:.3g} s"],
        {"busy_s": s.busy_s, "wall_s": s.wall_s, "requests": s.requests, "optim_steps": s.optim_steps},
        advice="send before you wait: submit a step's requests (every sample, then forward_backward and optim_step) "
               "and call .result() after; time the loop's own code between requests")


def samples_one_by_one(s: Session) -> Verdict | None:
    calls = [t for times in s.serial.values() for t in times]
    if len(calls) < SERIAL_CALLS:
        return None
    saving = sum(sum(times) - max(times) for times in s.serial.values()) / s.wall_s
    total = sum(calls)
    return Verdict(
        "samples_one_by_one", "sample calls awaited one by one", total / s.wall_s, _basis(s),
        f"{len(calls)} engine calls of {len(s.serial)} sampler(s), each sent after the one before had ended", "", None,
        f"one engine batch per sampler: sample time from {total:.3g} s toward its longest call's", saving,
        [f"calls {', '.join(f'{1000 * t:.3g}' for t in calls[:8])}{' ...' if len(calls) > 8 else ''} ms"],
        {"calls_s": calls, "wall_s": s.wall_s}, {"sample_s_at_most": total, "sample_s_at_least": sum(
            max(times) for times in s.serial.values())},
        advice="submit all of a step's sample requests (their futures), then call .result() on each")


def sampler_switches(s: Session) -> Verdict | None:
    again = s.loads - s.samplers
    if again <= 0 or s.load_s / s.wall_s < MIN_SAVING:
        return None
    each = s.load_s / s.loads
    return Verdict(
        "sampler_switches", "the engine taking samplers' weights", s.load_s / s.wall_s, _basis(s),
        f"{s.loads} weight loads for {s.samplers} sampler(s), {1000 * each:.3g} ms each: samplers sampled in turn",
        "", None, "one load per sampler", again * each / s.wall_s, [f"load_weights {s.load_s:.3g} s"],
        {"loads": s.loads, "samplers": s.samplers, "load_s": s.load_s},
        advice="sample each sampler's requests together, then the next sampler's")


def _basis(s: Session) -> str:
    return f"of session {s.id}'s wall time ({s.wall_s:.3g} s)"


RULES = [loop_between_requests, samples_one_by_one, sampler_switches]


def verdicts(spans: list[dict], top: int = 3) -> list[Verdict]:
    """The served sessions' verdicts that could save >= MIN_SAVING of their session, largest saving first."""
    found = [v for s in sessions(spans) for rule in RULES if (v := rule(s)) is not None and v.saving >= MIN_SAVING]
    return sorted(found, key=lambda v: -v.saving)[:top]
