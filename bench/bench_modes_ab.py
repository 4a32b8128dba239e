"""bench_modes.py on two checkouts of plait, round by round: the before/after of a change, measured alike.

Two runs of bench_modes.py minutes apart do not share a machine: on a 2-core host an async mode's step falls
into a fast or a slow regime (both threads at full speed, or each about 1.5x slower) run by run, and a
neighbour's job or the load the previous run left decides which, so a before-then-after pair read 0.1-0.2
apart on unchanged hot paths. Here each round runs bench_modes.py once (`--rounds 1`, every mode, in a fresh
process) in the checkout BEFORE and then in AFTER (the order alternates by round), so both sides meet the same
drift; per side, the median over rounds of each mode's samples/s ratio to the same run's sync. Each checkout
runs its own bench_modes.py with its own plait (PYTHONPATH), the one interpreter running this.

    python bench/bench_modes_ab.py --before DIR [--after .] [--rounds 4] [--out bench/results/modes_ab.json]
                                   -- [bench_modes.py's arguments, e.g. --workloads balanced --steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine import capability


def one_run(checkout: str, extra: list[str], out: str) -> dict:
    """bench_modes.py --rounds 1 in `checkout`; its result per setting."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    done = subprocess.run([sys.executable, "bench/bench_modes.py", "--rounds", "1", "--out", out, *extra],
                          cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_modes.py failed in {checkout}:\n{done.stderr[-3000:]}")
    print(f"{checkout}: " + " | ".join(line.split(": ", 1)[-1] for line in done.stdout.splitlines() if "samples/s x" in line),
          flush=True)
    with open(out) as f:
        return json.load(f)


def commit(checkout: str) -> str:
    """The checkout's commit (its path is this machine's own, not recorded)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the checkout before the change (git worktree add --detach DIR REV)")
    ap.add_argument("--after", default=".")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="bench/results/modes_ab.json")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench_modes.py's own arguments")
    args = ap.parse_args()
    extra = [a for a in args.rest if a != "--"]
    sides = {"before": args.before, "after": args.after}
    runs: dict[str, dict[str, list]] = {}  # setting -> side -> that side's rounds (bench_modes' round records)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for side in order:
                result = one_run(sides[side], extra, os.path.join(tmp, f"{side}-{i}.json"))
                for setting, r in result.items():
                    runs.setdefault(setting, {}).setdefault(side, []).extend(r["rounds"])
    out = {}
    for setting, by_side in runs.items():
        modes = list(by_side["after"][0])
        ratios = {side: {m: [r[m]["samples_per_s"] / r["sync"]["samples_per_s"] for r in rounds] for m in modes}
                  for side, rounds in by_side.items()}
        median = {side: {m: statistics.median(v) for m, v in r.items()} for side, r in ratios.items()}
        loads = [max(r[m]["load_before"], r[m]["load_after"]) for rounds in by_side.values() for r in rounds for m in modes]
        out[setting] = {"rounds": args.rounds, "args": extra, "samples_per_s_vs_sync": median, "per_round": ratios,
                        "load_max": max(loads), "load_median": statistics.median(loads), "capability": capability(),
                        "commits": {side: commit(path) for side, path in sides.items()}}
        for m in modes[1:]:
            b, a = median["before"][m], median["after"][m]
            print(f"{setting}: {m:15s} before x{b:.2f} after x{a:.2f} (after - before {a - b:+.2f}); per round: before "
                  f"{' '.join(f'{x:.2f}' for x in ratios['before'][m])}, after {' '.join(f'{x:.2f}' for x in ratios['after'][m])}")
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results.update(out)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
