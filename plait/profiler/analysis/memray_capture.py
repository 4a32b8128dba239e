"""A memray capture (global_profiler.tool=memray) as the report shows it: memory over time, sites, flame graph.

    read(path)         in a child process: the capture's resident memory every 10 ms, its heap peak, and
                       the allocation sites live at its high-water mark, as plain JSON
    report(path, stages, html)   runs `memray flamegraph` (memray's own page) into `html`, then reads
                       the capture as above into a memory.MemoryReport set against the timeline's stages

Both run memray in a child process with a time limit: a capture is read as untrusted input, and memray's
reader is native code, so a crafted or torn file can at worst fail that process, never the report.
Without memray installed the report says so and links the raw capture only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from typing import Optional

from plait.profiler.analysis import memory as mem

DEVICE = "host (memray)"  # MemoryReport.device of a capture
TIMEOUT_S = 300
N_SITES = 10


def available() -> bool:
    return importlib.util.find_spec("memray") is not None


def read(path: str) -> dict:
    """{series: [(wall s, RSS bytes)], heap_peak: bytes, sites: [(site, bytes)]}; needs memray."""
    import memray
    reader = memray.FileReader(path)
    try:
        sites: dict[str, int] = defaultdict(int)
        for record in reader.get_high_watermark_allocation_records(merge_threads=True):
            frames = [f"{file}({line}): {function}" for function, file, line in record.stack_trace()]
            sites[mem.site_of(frames)] += record.size
        return {"series": [(s.time / 1000, s.rss) for s in reader.get_memory_snapshots()],
                "heap_peak": reader.metadata.peak_memory,
                "sites": sorted(sites.items(), key=lambda kv: -kv[1])[:N_SITES]}
    finally:
        reader.close()


def report(path: str, stages: list[dict], html: str) -> tuple[Optional[mem.MemoryReport], int, list[str]]:
    """(the capture's MemoryReport or None, its heap peak in bytes, notes); writes the flame graph to `html`."""
    notes = []
    # The live report rewrites the page every few steps: a flame graph newer than its capture is kept.
    if not (os.path.isfile(html) and os.path.getmtime(html) >= os.path.getmtime(path)):
        flame = subprocess.run([sys.executable, "-m", "memray", "flamegraph", "-f", "-o", html, path],
                               capture_output=True, text=True, timeout=TIMEOUT_S)
        if flame.returncode != 0 or not os.path.isfile(html):
            notes.append(f"memray flamegraph failed: {_last_line(flame.stderr or flame.stdout)}")
    got = subprocess.run([sys.executable, "-m", "plait.profiler.analysis.memray_capture", path],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    if got.returncode != 0:
        return None, 0, notes + [f"memray could not read it: {_last_line(got.stderr)}"]
    data = json.loads(got.stdout)
    series = [(float(t), int(b)) for t, b in data["series"]]
    if not series:
        return None, int(data["heap_peak"]), notes + ["no memory samples in it"]
    peak_i = max(range(len(series)), key=lambda i: series[i][1])
    t, peak = series[peak_i]
    return (mem.MemoryReport(DEVICE, peak, t, mem.stage_at(stages, t),
                             [(str(s), int(b)) for s, b in data["sites"]], series, mem.growth_per_stage(series, stages)),
            int(data["heap_peak"]), notes)


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no message)"


if __name__ == "__main__":
    print(json.dumps(read(sys.argv[1])))
