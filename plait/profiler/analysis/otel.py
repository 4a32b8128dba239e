"""`plait profile export-otel DIR --endpoint URL`: a run's timeline and sample lifecycles as OpenTelemetry spans.

    DIR's timeline.jsonl + samples.jsonl (read as untrusted data, inputs.py)
    ─▶ one trace per step:  rl.step                              the step's first span start .. last span end
                              ├─ rl.stage.<stage>                every timeline span of the step (every role
                              │                                  and Ray rank), rl.role / rl.rank / rl.thread
                              └─ rl.sample                       one per sample of the step, its lifecycle's
                                   └─ rl.sample.<span>           extent; a child per part (gen, queued, reward)
    ─▶ OTLP/HTTP protobuf POSTs to URL/v1/traces (Tempo, Jaeger, an OpenTelemetry Collector)

Span times are the files' own wall-clock times. Needs the `otel` extra (opentelemetry-sdk and its OTLP/HTTP
exporter). Left out: metrics and the profiler's traces (Perfetto reads those: `plait profile report`).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

from plait.profiler.analysis.inputs import locate

BATCH = 512  # spans per POST


def _ns(t: float) -> int:
    return int(t * 1e9)


def export(path: str, endpoint: str, timeout_s: float = 10.0) -> str:
    """Send DIR's spans to `endpoint` (http://host:4318); returns one line saying what was sent. Raises
    ImportError without the otel extra and ConnectionError when the endpoint refuses a batch."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    inp = locate(path)
    run = os.path.basename(os.path.abspath(inp.run_dir or path))
    collected = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "plait", "rl.run": run}))
    provider.add_span_processor(SimpleSpanProcessor(collected))
    tracer = provider.get_tracer("plait.profiler")
    spans, samples = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for s in inp.spans:
        spans[s["step"]].append(s)
    for r in inp.samples:
        samples[r["step"]][r["sample"]].append(r)
    for step in sorted(set(spans) | set(samples)):
        parts = spans[step] + [r for lives in samples[step].values() for r in lives]
        root = tracer.start_span("rl.step", start_time=_ns(min(p["start"] for p in parts)), attributes={"rl.step": step})
        under_step = trace.set_span_in_context(root)
        for s in spans[step]:
            attrs = {"rl.step": step, "rl.role": s["role"], "rl.stage": s["stage"], "rl.thread": s["thread"],
                     "process.pid": s["pid"], **({"rl.rank": s["rank"]} if s["rank"] is not None else {}),
                     **({"rl.policy_version": s["version"]} if s["version"] is not None else {})}
            tracer.start_span(f"rl.stage.{s['stage']}", context=under_step, start_time=_ns(s["start"]),
                              attributes=attrs).end(end_time=_ns(s["end"]))
        for sample, life in samples[step].items():
            span = tracer.start_span("rl.sample", context=under_step, start_time=_ns(min(r["start"] for r in life)),
                                     attributes={"rl.sample.id": sample, "rl.step": step})
            for r in life:
                attrs = {"rl.sample.id": sample, "rl.step": step, **{f"rl.{k}": v for k, v in r["attrs"].items()},
                         **({"rl.policy_version": r["version"]} if r["version"] is not None else {})}
                tracer.start_span(f"rl.sample.{r['span']}", context=trace.set_span_in_context(span),
                                  start_time=_ns(r["start"]), attributes=attrs).end(end_time=_ns(r["end"]))
            span.end(end_time=_ns(max(r["end"] for r in life)))
        root.end(end_time=_ns(max(p["end"] for p in parts)))
    finished = collected.get_finished_spans()
    url = endpoint.rstrip("/") + "/v1/traces"
    exporter = OTLPSpanExporter(endpoint=url, timeout=timeout_s)
    # its own log line per failed try would come before ours, which says the same in one line
    logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").setLevel(logging.CRITICAL)
    for i in range(0, len(finished), BATCH):
        if exporter.export(finished[i:i + BATCH]) != SpanExportResult.SUCCESS:
            raise ConnectionError(f"{url} did not accept spans {i + 1}-{min(i + BATCH, len(finished))} of {len(finished)} "
                          "(is an OTLP/HTTP receiver listening there?)")
    exporter.shutdown()
    return (f"plait profile export-otel: {len(finished)} spans ({len(spans)} steps' timeline, "
            f"{sum(len(v) for v in samples.values())} samples) of {run} sent to {url}")
