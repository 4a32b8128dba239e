"""Reading what the profiler and the timeline recorded: `plait profile report DIR`.

    traces.py   torch traces + timeline on one wall clock: the merged Perfetto trace, top operators
    memory.py   peak, stage, allocation sites and growth, from CUDA snapshots and CPU memory traces
    svg.py      the report's inline charts
    accounting.py  every second of each step per thread: named spans plus what is unattributed
    verdict.py  rules over those shares, metrics and the run summary: the bottleneck and the key to try
    report.py   finds the files, writes report/index.html and report/timeline.json.gz

Recording lives beside it (plait/profiler/timeline.py, tools/); nothing here runs during training.
"""

from plait.profiler.analysis.report import build_report

__all__ = ["build_report"]
