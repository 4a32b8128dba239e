"""The local Tinker survives a restart: `plait serve` run as a subprocess on 127.0.0.1, trained through the real
`tinker` SDK, killed with SIGKILL after save_state and started again on the same --tinker-dir. The SDK's own
client goes on where it saved; retried requests (the same model and seq_id, as the SDK resends them) get their
first answer and are not run again, before and after the kill; a client that trained past its last save comes
back refusing to train until it loads a checkpoint, and a fresh client loads the saved state exactly."""

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

tinker = pytest.importorskip("tinker")
import httpx  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow  # two server starts in subprocesses

NAME = "tiny-restart"
KEY = {"X-API-Key": "tml-restart"}


def start(model: str, root: str, port: int, ignoring_sigint: bool = False) -> subprocess.Popen:
    """`plait serve` on `port`, returned once it says it is serving (its line on stderr); `ignoring_sigint`: started
    with SIGINT ignored, as a script's `plait serve &` is."""
    code = "import sys; from plait.cli import main; sys.exit(main(sys.argv[1:]))"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignoring_sigint else None
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", model, "--name", NAME, "--port", str(port),
                             "--tinker-dir", root, "--max-tokens", "16"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TINKER_TELEMETRY": "0"}, preexec_fn=ignore)
    seen, serving, ended = [], threading.Event(), threading.Event()

    def drain():  # all of stderr, so that a full pipe never blocks the server
        for line in proc.stderr:
            seen.append(line)
            if "Tinker at" in line:
                serving.set()
        ended.set()
    threading.Thread(target=drain, daemon=True).start()
    while not serving.wait(0.2):
        if ended.is_set():
            raise AssertionError(f"plait serve did not start: {''.join(seen)}")
    proc.seen = seen
    return proc


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal `plait serve` and wait for it to exit; if it outlives the signal by a minute, fail with what it said."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"plait serve did not exit within 60 s of signal {sig}; its stderr:\n"
                             + "".join(proc.seen[-40:])) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sft(tokenizer, text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def loss(client, data) -> float:
    return client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]


def test_sessions_futures_and_clients_survive_a_kill_and_retries_are_applied_once(tmp_path, monkeypatch):
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from transformers import AutoTokenizer

    from plait.models import create_tiny_model
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    model = str(create_tiny_model(tmp_path / "model", size="xs", seed=3))
    root, port = str(tmp_path / "tinker"), free_port()
    url = f"http://127.0.0.1:{port}"
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = [sft(tokenizer, "survive a restart")]

    def retried(client, loss_fn_seq: int, optim_seq: int) -> tuple[bytes, dict]:
        """A forward_backward and an optim_step sent as the SDK sends them, with our own seq_ids, and their answers."""
        request = types.ForwardBackwardRequest(model_id=client.model_id, seq_id=loss_fn_seq,
                                               forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"))
        body = forward_backward_request_to_proto(request).SerializeToString()
        ids = [httpx.post(f"{url}/api/v1/forward_backward", content=body, timeout=30,
                          headers={**KEY, "Content-Type": "application/x-protobuf"}).json()["request_id"],
               httpx.post(f"{url}/api/v1/optim_step", json={"adam_params": {"learning_rate": 1e-2}, "seq_id": optim_seq,
                                                             "model_id": client.model_id}, headers=KEY, timeout=30).json()["request_id"]]
        fwd, optim = (httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": i}, headers=KEY, timeout=60)
                      for i in ids)
        return fwd.content, optim.json()

    server = start(model, root, port)
    try:
        service = tinker.ServiceClient(base_url=url, api_key="tml-restart")
        client = service.create_lora_training_client(base_model=NAME, rank=4, seed=0).result(timeout=60)
        for _ in range(2):
            client.forward_backward(data, "cross_entropy").result(timeout=60)
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        first = retried(client, 10_000, 10_001)
        assert retried(client, 10_000, 10_001) == first  # sent again: the first answers, no second step
        path = client.save_state("before-kill").result(timeout=60).path
        at_save = loss(client, data)
        other = service.create_lora_training_client(base_model=NAME, rank=4, seed=1).result(timeout=60)
        other.forward_backward(data, "cross_entropy").result(timeout=60)  # trained, never saved
    finally:
        stop(server, signal.SIGKILL)

    server = start(model, root, port)
    try:
        # retried after the restart: still the first answers, and not applied (the loss is the saved one)
        assert retried(client, 10_000, 10_001) == first
        assert first[1]["metrics"]["step:max"] == 3.0
        assert loss(client, data) == at_save
        # the SDK's own client and session go on: the next step trains from the saved state
        client.forward_backward(data, "cross_entropy").result(timeout=60)
        step = client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert step.metrics["step:max"] == 4.0  # its step count came back with the optimizer
        assert loss(client, data) < at_save
        # a client that trained past its last save is refused until it loads a checkpoint, naming why
        with pytest.raises(tinker.BadRequestError, match="restarted after it trained past its last checkpoint"):
            other.forward_backward(data, "cross_entropy").result(timeout=30)
        # a fresh SDK client from the tinker:// path: the saved state exactly
        fresh = tinker.ServiceClient(base_url=url, api_key="tml-restart")
        resumed = fresh.create_training_client_from_state_with_optimizer(path).result(timeout=60)
        assert loss(resumed, data) == at_save
        # an unknown future of a session from before the restart: 410, send it again
        gone = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": f"{client.model_id}:999999"},
                          headers=KEY, timeout=30)
        assert gone.status_code == 410 and "send the request again" in gone.json()["error"]
        fresh.close("success").result(timeout=30)
        service.close("success").result(timeout=30)
    finally:
        stop(server, signal.SIGINT)
    with open(os.path.join(root, "server.jsonl")) as f:  # each retried request ran once: one line for its answer
        futures = [line for line in f if f'"{client.model_id}:10000"' in line]
    assert len(futures) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_plait_serve_started_with_sigint_ignored_still_stops_on_sigint_and_sigterm(tmp_path, sig):
    """A background job of a non-interactive shell starts with SIGINT ignored, and Python keeps it so: a `plait serve`
    started that way had outlived the SIGINT meant to stop it. It installs its own handlers, and SIGTERM closes it the
    same way (its timeline written)."""
    from plait.models import create_tiny_model
    model = str(create_tiny_model(tmp_path / "model", size="xs", seed=3))
    server = start(model, str(tmp_path / "tinker"), free_port(), ignoring_sigint=True)
    stop(server, sig)
    assert server.returncode == 0, "".join(server.seen)
