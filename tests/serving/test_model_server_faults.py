"""ModelServer (`plait serve`, a judge's replica) over a real tiny model, meeting its faults: token ids outside the
vocabulary, a prompt past the model's context and an engine that fails a round are each a JSON error for the
request that brought them, and the server goes on answering the next ones."""

import logging

import pytest
import requests

from plait.config import RolloutConfig
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
from plait.profiler.session import ProfilerSession
from plait.serving.serve import ModelServer

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from plait.models import create_tiny_model
    return create_tiny_model(tmp_path_factory.mktemp("served") / "m", size="xs", seed=5)


@pytest.fixture(scope="module")
def served_model(model_path):
    path = model_path
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    server = ModelServer(path, RolloutConfig(name="hf"), profiler, name="tiny", max_tokens=8)  # as `plait serve`
    yield server
    server.close()


def test_token_ids_outside_the_vocabulary_are_a_400_before_the_engine(served_model):
    """They reached the engine, whose round raised IndexError: its thread died, the request timed out and no later
    request was answered (a training run through a session ended rc 1)."""
    s = served_model
    vocab = len(s.gateway.tokenizer)
    session = s.gateway.open("row 0", s.queue.generate, {"temperature": 1.0, "do_sample": True}, 256, 8)
    try:
        for path, body, param in (("/v1/completions", {"prompt": [5, 6, 100_000], "max_tokens": 2}, "prompt"),
                                  ("/generate", {"input_ids": [5, vocab]}, "input_ids"),
                                  (f"/sessions/{session.id}/v1/completions", {"prompt": [vocab + 7]}, "prompt")):
            r = requests.post(s.url + path, json=body, timeout=20)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param, (path, r.text)
            assert str(body.get("prompt", body.get("input_ids"))[-1]) in error["message"] and f"{vocab - 1}" in error["message"]
    finally:
        s.gateway.close(session.id)
    r = requests.post(s.url + "/v1/completions", json={"prompt": [5, 6, vocab - 1], "max_tokens": 2}, timeout=20)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_a_prompt_past_the_models_context_is_a_400(served_model):
    """`plait serve` answered a prompt longer than the model's context 200 (no bound but the judge's own)."""
    s = served_model
    context = 512  # the tiny model's max_position_embeddings
    r = requests.post(s.url + "/v1/completions", json={"prompt": [5] * (context + 8), "max_tokens": 2}, timeout=20)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert f"{context + 8} tokens" in error["message"] and f"{context} in all" in error["message"]
    r = requests.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 600}]}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = requests.post(s.url + "/v1/completions", json={"prompt": [5] * (context - 4), "max_tokens": 100}, timeout=20)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4  # the answer clamped to what is left


def test_an_engine_that_fails_a_round_fails_its_callers_fast_and_the_server_goes_on(served_model, monkeypatch,
                                                                                        capfd, caplog):
    """ModelServer's engine thread had no error handling: a round that raised left its callers waiting forever and
    the thread dead. A fault is planted in the engine (its generate raises), then taken away."""
    s = served_model

    def planted(*args, **kwargs):
        raise RuntimeError("planted engine fault")
    monkeypatch.setattr(s.rollout.engine, "generate", planted)
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = requests.post(s.url + path, json=HI, timeout=20)
        assert r.status_code == 500 and "planted engine fault" in r.text, r.text
        error = r.json()["error"]
        assert error["type"] == ("server_error" if path.endswith("completions") else "api_error")
    monkeypatch.undo()
    assert requests.post(s.url + "/v1/chat/completions", json=HI, timeout=20).status_code == 200
    err = capfd.readouterr().err
    assert err.count("the serve engine failed a round") == 1 and "Traceback" not in err, err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_plait_serve_takes_its_body_limit(model_path):
    """`plait serve --max-body-mb`: the request body bound is the user's to set (8 MiB unless told)."""
    import threading

    from plait.configtree import ConfigError
    from plait.serving.serve import serve
    with pytest.raises(ConfigError, match="--max-body-mb"):
        serve(model_path, max_body_mb=0)
    urls, stop = [], threading.Event()
    thread = threading.Thread(target=serve, args=(model_path,),
                              kwargs=dict(port=0, ready=urls.append, stop=stop, max_body_mb=0.01))
    thread.start()
    try:
        while not urls and thread.is_alive():
            thread.join(0.05)
        big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
        r = requests.post(urls[0] + "/v1/chat/completions", json=big, timeout=20)
        assert r.status_code == 413 and "larger than 10485 bytes" in r.json()["error"]["message"]
    finally:
        stop.set()
        thread.join(30)
