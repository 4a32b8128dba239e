"""`plait profile export-otel`: a real tiny run's timeline and sample lifecycles reach an OTLP/HTTP receiver.

The receiver is this test's own: an HTTP server on 127.0.0.1 decoding each POST to /v1/traces with the
OTLP protobuf classes (opentelemetry-proto), so what arrives is checked as Tempo or a Collector would read it.
"""

import http.server
import json
import sys
import threading
from collections import Counter

import pytest

from plait import cli, driver
from plait.profiler.analysis.inputs import read_jsonl

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse)


class Receiver(http.server.BaseHTTPRequestHandler):
    got: list = []  # (path, ExportTraceServiceRequest)

    def do_POST(self):
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        Receiver.got.append((self.path, request))
        body = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    Receiver.got = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def received_spans() -> list[tuple[dict, object]]:
    return [({a.key: a.value.string_value for a in rs.resource.attributes}, span)
            for _, request in Receiver.got for rs in request.resource_spans
            for ss in rs.scope_spans for span in ss.spans]


def attr(span, key):
    value = next(a.value for a in span.attributes if a.key == key)
    return getattr(value, value.WhichOneof("value"))


def test_a_runs_timeline_and_samples_arrive_as_rl_spans(tmp_path, tiny_config, receiver, capsys):
    out = tmp_path / "run"
    driver.build(tiny_config(out, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                             "trainer.val_before_train=false"), progress=False).run()
    timeline = list(read_jsonl(str(out / "timeline.jsonl"), []))
    samples = list(read_jsonl(str(out / "samples.jsonl"), []))
    capsys.readouterr()

    assert cli.main(["profile", "export-otel", str(out), "--endpoint", receiver]) == 0
    assert "spans" in capsys.readouterr().out
    assert {path for path, _ in Receiver.got} == {"/v1/traces"}
    spans = received_spans()
    assert all(resource["service.name"] == "plait" and resource["rl.run"] == "run" for resource, _ in spans)
    spans = [s for _, s in spans]
    names = Counter(s.name for s in spans)
    assert names["rl.step"] == 2 and {"rl.stage.gen", "rl.stage.reward", "rl.stage.update_actor"} <= set(names)
    assert sum(n for name, n in names.items() if name.startswith("rl.stage.")) == len(timeline)
    assert names["rl.sample"] == len({(r["step"], r["sample"]) for r in samples})
    assert sum(n for name, n in names.items() if name.startswith("rl.sample.")) == len(samples)

    by_id = {s.span_id: s for s in spans}
    roots = {s.trace_id: s for s in spans if s.name == "rl.step"}
    assert len(roots) == 2  # one trace per step
    for s in spans:
        if s.name == "rl.step":
            assert not s.parent_span_id
            continue
        parent = by_id[s.parent_span_id]
        assert s.trace_id == parent.trace_id and attr(s, "rl.step") == attr(roots[s.trace_id], "rl.step")
        assert parent.name == ("rl.sample" if s.name.startswith("rl.sample.") else "rl.step")
        assert parent.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= parent.end_time_unix_nano
    # the file's own times, to the microsecond
    gen = next(r for r in timeline if r["stage"] == "gen" and r["step"] == 1)
    sent = next(s for s in spans if s.name == "rl.stage.gen" and attr(s, "rl.step") == 1)
    assert abs(sent.start_time_unix_nano / 1e9 - gen["start"]) < 1e-6 and attr(sent, "rl.role") == gen["role"]
    one = samples[0]
    life = next(s for s in spans if s.name == "rl.sample" and attr(s, "rl.sample.id") == one["sample"])
    assert abs(life.start_time_unix_nano / 1e9 - min(r["start"] for r in samples if r["sample"] == one["sample"]
                                                     and r["step"] == one["step"])) < 1e-6


def test_no_receiver_is_one_line(tmp_path, capsys):
    (tmp_path / "timeline.jsonl").write_text(json.dumps(
        {"step": 1, "pid": 1, "role": "trainer", "stage": "gen", "thread": "MainThread", "start": 1.0, "end": 2.0,
         "version": 0}) + "\n")
    assert cli.main(["profile", "export-otel", str(tmp_path), "--endpoint", "http://127.0.0.1:9",
                     "--timeout", "0.5"]) == 1  # nothing listens on port 9
    err = capsys.readouterr().err
    assert err.splitlines() == ["plait: profile export-otel: http://127.0.0.1:9/v1/traces did not accept spans 1-2 of 2 "
                                "(is an OTLP/HTTP receiver listening there?)"]


def test_without_the_extra_it_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "timeline.jsonl").write_text("")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # not installed
    assert cli.main(["profile", "export-otel", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "plait: profile export-otel: needs opentelemetry.exporter.otlp.proto.http.trace_exporter: pip install 'plait[otel]'"]
