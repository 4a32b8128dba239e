"""The gateway's server bounded like a production server, driven with real HTTP on 127.0.0.1 (raw sockets where a
client must misbehave): deep JSON, large and slow bodies, slow heads, clients that go away, lone surrogates and
unknown routes are each answered in the API's own error shape, and nothing prints a traceback."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import requests

from gateway_helpers import served
from plait.serving.server import Limits

HI = {"messages": [{"role": "user", "content": "hi"}]}


def raw(url: str, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    """The answer to `head` + `body` sent as they are, read whole (its head and Content-Length bytes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
                answer.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def no_tracebacks(capfd, caplog) -> None:
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.records


def test_deep_json_is_a_400_on_every_route(tokenizer, capfd, caplog):
    """100,000 nested arrays: Python's parser raised RecursionError (a 500 and a traceback) on every route."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with served(tokenizer, plain=False) as (gateway, url, _e, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        for path in ("/v1/chat/completions", "/v1/completions", "/generate", f"/sessions/{session.id}/v1/chat/completions",
                     f"/sessions/{session.id}/reward", "/v1/messages"):
            r = requests.post(url + path, data=b'{"messages": ' + deep + b"}", headers={"x-api-key": session.id})
            error = r.json()["error"]
            assert r.status_code == 400 and "nested deeper than 64" in error["message"], (path, r.text[:200])
            assert error["type"] == "invalid_request_error"
        r = requests.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "[{" * 100}]},
                          headers={"authorization": f"Bearer {session.id}"})
        assert r.status_code == 200  # brackets inside a string are text, not nesting
    no_tracebacks(capfd, caplog)


def test_a_body_past_the_limit_is_a_413_before_it_is_read(tokenizer):
    """A 50 MB body grew the server past 4 GiB: it is refused by its Content-Length before a byte is read, and as it
    streams in when it has none (chunked)."""
    with served(tokenizer, limits=Limits(max_body_bytes=1 << 20)) as (_, url, _e, _q):
        t = time.time()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        answer = raw(url, head + b"Content-Length: 50000000\r\n\r\n", b'{"messages": [')  # the rest never comes
        assert answer.startswith(b"HTTP/1.1 413") and b"larger than 1048576 bytes" in answer
        assert b"connection: close" in answer.lower()  # the unread rest is not taken for a next request
        assert time.time() - t < 5
        chunks = (b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16)) for _ in range(64))  # 4 MiB of spaces, chunked
        r = requests.post(url + "/v1/chat/completions", data=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        assert requests.post(url + "/v1/chat/completions", json=HI).status_code == 200


def test_a_client_that_goes_away_costs_only_its_request(tokenizer, capfd, caplog):
    """A client that half-sent its body and closed printed starlette's ClientDisconnect traceback."""
    with served(tokenizer, limits=Limits(body_timeout_s=1.0)) as (_, url, _e, _q):
        host, port = url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess")
                time.sleep(0.2)
        slow = raw(url, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", b'{"model"')
        assert slow.startswith(b"HTTP/1.1 408") and b'"type":"error"' in slow  # Anthropic's shape on its route
        assert requests.post(url + "/v1/chat/completions", json=HI).status_code == 200
    no_tracebacks(capfd, caplog)


def test_a_lone_surrogate_is_a_400_wherever_it_is(tokenizer):
    """A lone surrogate in a message was a 400, in a tool's name a 200: both are 400 naming the field."""
    tools = [{"type": "function", "function": {"name": "add\\ud800", "parameters": {"type": "object"}}}]
    with served(tokenizer) as (_, url, _e, _q):
        for body, param in (('{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages[0].content"),
                            ('{"messages": [{"role": "user", "content": "hi"}], "tools": %s}' % json.dumps(tools)
                             .replace("\\\\", "\\"), "tools[0].function.name")):
            r = requests.post(url + "/v1/chat/completions", data=body.encode())
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "lone surrogate" in r.json()["error"]["message"]
        r = requests.post(url + "/v1/messages", data=b'{"max_tokens": 5, "messages": [{"role": "user", "content": "a"}],'
                                                      b' "tools": [{"name": "\\ud83d", "input_schema": {}}]}')
        assert r.status_code == 400 and r.json()["type"] == "error" and "tools[0].name" in r.json()["error"]["message"]
        paired = requests.post(url + "/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
        assert paired.status_code == 200  # a pair is one character (an emoji)


def test_unknown_routes_and_methods_answer_in_the_apis_shape(tokenizer):
    """They were Starlette's plain-text "Not Found" / "Method Not Allowed"."""
    with served(tokenizer) as (_, url, _e, _q):
        r = requests.post(url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        assert "POST /v1/embeddings" in r.json()["error"]["message"]
        r = requests.get(url + "/v1/chat/completions")
        assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]
        assert "POST" in r.json()["error"]["message"]
        r = requests.post(url + "/v1/messages/batches", json={})
        assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        r = requests.post(url + "/sessions/abc/v1/nothing", json={})
        assert r.status_code == 404 and "/sessions/abc/v1/nothing" in r.json()["error"]["message"]


SERVER = """
import sys, time
sys.path.insert(0, {here!r})
from gateway_helpers import served, CHATML
from plait.models import build_char_tokenizer
from plait.serving.server import Limits
tok = build_char_tokenizer(); tok.chat_template = CHATML
with served(tok, script=lambda text: "hi", limits=Limits(head_timeout_s=30.0, body_timeout_s=30.0)) as (_, url, _e, _q):
    print(url, flush=True)
    sys.stdin.read()
"""


def test_slow_clients_leave_normal_requests_answered(tmp_path):
    """Slowloris: 1,100 clients each holding a connection with half a head (or half a body) left normal requests
    unanswered and printed a traceback per accept out of file descriptors (1.3 M). Here the server may hold 256 files
    (soft and hard limit: it holds 96 connections); 160 slow bodies, then 160 slow heads are connected while 10 normal requests are sent."""
    import resource

    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(here=os.path.dirname(__file__))], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w"),
                              preexec_fn=few_files, text=True)
    slow = []
    try:
        url = server.stdout.readline().strip()
        host, port = url.removeprefix("http://").split(":")
        for body in (True, True, False, False):  # 80 at once (a blocking connect to a full accept queue waits 1 s)
            wave = [socket.socket() for _ in range(80)]
            for s in wave:
                s.setblocking(False)
                s.connect_ex((host, int(port)))
            for s in wave:
                s.settimeout(10)
                try:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + (
                        b"Content-Length: 1000\r\n\r\n{" if body else b""))
                except OSError:  # dropped already, for a newer slow client
                    pass
            slow += wave
            time.sleep(0.3)
        answered = 0
        for _ in range(10):
            r = requests.post(url + "/v1/chat/completions", json=HI, timeout=10)
            answered += r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
        assert answered == 10
    finally:
        for s in slow:
            s.close()
        server.stdin.close()
        server.wait(timeout=30)
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "Too many open files" not in err, err[-2000:]
