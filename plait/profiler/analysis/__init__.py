"""Reading what the profiler and the timeline recorded: `plait profile report DIR`, `plait profile diff A B`.

    inputs.py   every file of a run's folders read as untrusted data: bounded, checked, skipped in one note
    traces.py   torch traces streamed onto one integer clock: merged Perfetto traces, operators per stage
    memory.py   peak, stage, allocation sites and growth, from CUDA snapshots and CPU memory traces
    memray_capture.py  a memray capture read in a child process: RSS over time, sites, memray's flame graph
    svg.py      the report's inline charts
    accounting.py  every second of each step per thread: named spans plus what is unattributed
    verdict.py  rules over those shares, metrics and the run summary: the bottleneck and the key to try
    memory_fit.py  each suggestion's predicted peak memory per role, from the run's per-stage peaks
    report.py   finds the files, writes report/index.html, verdict.json and the merged traces; --watch
    diff.py     one run against another, and A's verdict's predictions against B's measurements
    otel.py     `plait profile export-otel`: the timeline and sample lifecycles as OTLP spans

Recording lives beside it (plait/profiler/timeline.py, samples.py, tools/); nothing here runs during
training (the live report runs it in a process of its own: plait/profiler/live.py).
"""

from plait.profiler.analysis.diff import diff_runs
from plait.profiler.analysis.report import build_report, watch

__all__ = ["build_report", "diff_runs", "watch"]
