"""The local Tinker (plait/serving/tinker) driven only by the real `tinker` SDK (0.38) against `plait serve`'s server
(ModelServer with tinker_dir) on 127.0.0.1, over a tiny model built here: SFT lowers its loss, sampled log-probs
equal compute_logprobs and the trainer's forward, an RL loop with importance_sampling and ppo stays finite,
save_state/load_state round-trips the loss exactly, two LoRA clients do not mix, and malformed requests fail fast
naming the field while the server keeps serving. One server for the module."""

import concurrent.futures
import math
import os
import re
import time
import warnings

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from plait.config import RolloutConfig  # noqa: E402
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig  # noqa: E402
from plait.profiler.session import ProfilerSession  # noqa: E402
from plait.serving.serve import ModelServer  # noqa: E402

NAME = "tiny-tinker"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from plait.models import create_tiny_model
    root = tmp_path_factory.mktemp("tinker")
    path = create_tiny_model(root / "model", size="xs", seed=3)
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    server = ModelServer(path, RolloutConfig(name="hf"), profiler, name=NAME, max_tokens=16, tinker_dir=str(root / "ckpt"),
                         output_dir=str(root / "run"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_TELEMETRY", "0")  # the SDK's telemetry posts would only add requests
        yield server
    server.close()


@pytest.fixture(scope="module")
def service(served):
    client = tinker.ServiceClient(base_url=served.url, api_key="tml-local-test")
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def tokenizer(served):
    return served.gateway.tokenizer


def sft_datum(tokenizer, text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def step(client, data, loss_fn="cross_entropy", lr=1e-2, config=None):
    fwd_bwd = client.forward_backward(data, loss_fn, config)
    optim = client.optim_step(types.AdamParams(learning_rate=lr))
    out = fwd_bwd.result(timeout=60)
    optim.result(timeout=60)
    return out


def forward_logprobs(client, data) -> list[list[float]]:
    out = client.forward(data, "cross_entropy").result(timeout=60)
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def test_sft_with_cross_entropy_lowers_the_loss_and_reports_per_token_outputs(service, tokenizer):
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=0).result(timeout=60)
    data = [sft_datum(tokenizer, "hello world, hello plait"), sft_datum(tokenizer, "tinker on a laptop")]
    losses = []
    for _ in range(4):
        out = step(client, data)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses
    first = out.loss_fn_outputs[0]
    n = len(tokenizer.encode("hello world, hello plait")) - 1
    assert first["logprobs"].shape == [n] and first["elementwise_loss"].shape == [n]
    total = sum(-sum(o["logprobs"].tolist()) for o in out.loss_fn_outputs)  # weights are ones
    assert total == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
    info = client.get_info()
    assert info.lora_rank == 4 and info.model_data.model_name == NAME


def test_sampled_logprobs_equal_compute_logprobs_and_the_trainers_forward(service, tokenizer):
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=1).result(timeout=60)
    step(client, [sft_datum(tokenizer, "abcabcabc")])  # a non-zero adapter: the sampler must carry it
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = tokenizer.encode("abc")
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=7)).result(timeout=60)
    assert len(result.sequences) == 2
    scored_first = None
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result(timeout=60)
        assert scored[0] is None
        assert torch.allclose(torch.tensor(scored[len(prompt):]), torch.tensor(seq.logprobs), atol=1e-3)
        scored_first = scored_first or scored
        ids = prompt + seq.tokens
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        trained = forward_logprobs(client, [datum])[0][len(prompt) - 1:]
        assert torch.allclose(torch.tensor(trained), torch.tensor(seq.logprobs), atol=1e-3)  # on-policy
    # the sampler is a snapshot: training further does not move what it samples
    step(client, [sft_datum(tokenizer, "abcabcabc")])
    again = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + result.sequences[0].tokens)).result(timeout=60)
    assert again == scored_first
    base = service.create_sampling_client(base_model=NAME).result(timeout=60)
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(prompt + result.sequences[0].tokens)).result(timeout=60)
    assert base_lp[1:] != pytest.approx(again[1:], abs=1e-4)  # the base model is not the adapter


def test_samplers_draw_on_plaits_rollout_engine_and_keep_their_own_weights(served, service, tokenizer):
    from plait.workers.rollout_engine import TransformersEngine
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=11).result(timeout=60)
    step(client, [sft_datum(tokenizer, "xyzxyz")])
    first = client.save_weights_and_get_sampling_client().result(timeout=60)
    step(client, [sft_datum(tokenizer, "xyzxyz")])
    second = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = tokenizer.encode("xy")
    # temperature and top-k change what is drawn, not the log-probs returned: the model's own (compute_logprobs')
    params = types.SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=3, stop=[])
    drawn = first.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=60)
    assert isinstance(served.tinker.trainer.rollout.engine, TransformersEngine)  # the hf row of ENGINES
    again = first.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=60)
    assert [(s.tokens, s.logprobs) for s in again.sequences] == [(s.tokens, s.logprobs) for s in drawn.sequences]  # seeded
    for seq in drawn.sequences:
        scored = first.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result(timeout=60)
        assert torch.allclose(torch.tensor(scored[len(prompt):]), torch.tensor(seq.logprobs), atol=1e-3)
    # the engine holds one sampler at a time: switching back and forth reloads each one's own weights
    ids = types.ModelInput.from_ints(prompt + drawn.sequences[0].tokens)
    a = first.compute_logprobs(ids).result(timeout=60)
    b = second.compute_logprobs(ids).result(timeout=60)
    assert b[1:] != pytest.approx(a[1:], abs=1e-5)
    assert first.compute_logprobs(ids).result(timeout=60) == pytest.approx(a, abs=1e-6, nan_ok=True)
    # a stop token ends a sample after it, with stop_reason "stop"
    stop_at = drawn.sequences[0].tokens[1]
    cut = first.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(
        max_tokens=6, temperature=0.7, top_k=5, seed=3, stop=[stop_at])).result(timeout=60).sequences[0]
    assert cut.tokens == drawn.sequences[0].tokens[:drawn.sequences[0].tokens.index(stop_at) + 1]
    assert cut.stop_reason == "stop"


CONFIGS = {"importance_sampling": None, "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
           "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "dro": {"beta": 0.1}}


@pytest.mark.parametrize("loss_fn", CONFIGS)
def test_an_rl_loop_gives_finite_outputs(service, tokenizer, loss_fn):
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=2).result(timeout=60)
    prompt = tokenizer.encode("count a:")
    for _ in range(2):
        sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6)).result(timeout=60)
        rewards = [tokenizer.decode(s.tokens).count("a") for s in sampled.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for seq, reward in zip(sampled.sequences, rewards):
            ids = prompt + seq.tokens
            n = len(ids) - 1
            zeros = [0.0] * (len(prompt) - 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
                "target_tokens": ids[1:], "logprobs": zeros + list(seq.logprobs),
                "advantages": zeros + [reward - mean + 0.5] * (n - len(zeros))}))
        out = step(client, data, loss_fn, lr=1e-3, config=CONFIGS[loss_fn])
        assert math.isfinite(out.metrics["loss:sum"])
        for o in out.loss_fn_outputs:
            assert torch.isfinite(o["logprobs"].to_torch()).all() and torch.isfinite(o["elementwise_loss"].to_torch()).all()
    # on-policy data (the ratio is 1 on sampled tokens): importance_sampling's and ppo's loss is -sum(advantages);
    # cispo's weighs each advantage by its token's log-prob; dro's adds beta/2 * (logp - logprobs)^2 (the prompt's)
    advantages = [a for d in data for a in d.loss_fn_inputs["advantages"].tolist()]
    sampled = [lp for d in data for lp in d.loss_fn_inputs["logprobs"].tolist()]
    logprobs = [lp for o in out.loss_fn_outputs for lp in o["logprobs"].tolist()]
    expected = {"importance_sampling": lambda a, lp, old: -a, "ppo": lambda a, lp, old: -a,
                "cispo": lambda a, lp, old: -a * lp,
                "dro": lambda a, lp, old: -(a * lp - 0.05 * (lp - old) ** 2)}[loss_fn]
    expected = sum(expected(a, lp, old) for a, lp, old in zip(advantages, logprobs, sampled))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3, abs=1e-3)


def test_save_state_and_load_state_round_trip_the_loss_exactly(served, service, tokenizer):
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=3).result(timeout=60)
    data = [sft_datum(tokenizer, "save me, load me")]
    step(client, data)
    saved = client.save_state("step1").result(timeout=60)
    assert saved.path == f"tinker://{client.model_id}/weights/step1"
    loss_at_save = client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    after_one = step(client, data).metrics["loss:sum"]  # the loss before this step's update
    assert after_one == loss_at_save
    moved = client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert moved != loss_at_save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # load_state_with_optimizer is deprecated in 0.38, still served
        client.load_state_with_optimizer(saved.path).result(timeout=60)
    assert client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == loss_at_save
    # the checkpoint's adapter/ is a plain peft adapter over the served folder: the same loss without plait's server
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    adapter = os.path.join(served.tinker.trainer.folder(saved.path), "adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served.tinker.trainer.path), adapter)
    ids = [*data[0].model_input.to_ints(), data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    assert -logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum().item() == pytest.approx(loss_at_save, rel=1e-5)
    # a new client from the state (the SDK's recommended path), optimizer included: the same next step
    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result(timeout=60)
    assert resumed.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == loss_at_save
    step(client, data)
    step(resumed, data)
    assert resumed.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == \
        client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]


def test_futures_answer_try_again_until_done_and_custom_losses_run_client_side(service, tokenizer, monkeypatch):
    from plait.serving.tinker import routes
    monkeypatch.setattr(routes, "POLL_S", 0.0)  # every retrieve answers try_again until its job is done
    client = service.create_lora_training_client(base_model=NAME, rank=2, seed=7).result(timeout=60)
    data = [sft_datum(tokenizer, "polled until done")]
    built_in = client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]

    def custom(data, logprobs):  # the SDK runs it here and sends its gradient as cross_entropy's weights
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"mine": loss.item()}
    out = client.forward_backward_custom(data, custom).result(timeout=60)
    assert out.metrics["mine"] == pytest.approx(built_in, rel=1e-5)


def test_a_retried_request_is_applied_once(served, service):
    import httpx
    client = service.create_lora_training_client(base_model=NAME, rank=2, seed=8).result(timeout=60)
    headers = {"X-API-Key": "tml-retry"}

    def optim_step(seq_id: int) -> dict:
        body = {"adam_params": {"learning_rate": 1e-3}, "model_id": client.model_id, "seq_id": seq_id}
        request_id = httpx.post(f"{served.url}/api/v1/optim_step", json=body, headers=headers).json()["request_id"]
        return httpx.post(f"{served.url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers,
                          timeout=30).json()
    first = optim_step(1000)
    assert optim_step(1000) == first  # the same request sent again: its first answer, no second step
    assert optim_step(1001)["metrics"]["step:max"] == first["metrics"]["step:max"] + 1


def test_two_lora_clients_train_without_mixing(service, tokenizer):
    a = service.create_lora_training_client(base_model=NAME, rank=4, seed=4).result(timeout=60)
    b = service.create_lora_training_client(base_model=NAME, rank=8, seed=5, train_unembed=False).result(timeout=60)
    data = [sft_datum(tokenizer, "only a learns this")]
    step(b, data)  # b's own adapter is non-zero
    a_before, b_before = forward_logprobs(a, data), forward_logprobs(b, data)
    for _ in range(3):
        step(a, data)
    assert forward_logprobs(b, data) == b_before
    assert forward_logprobs(a, data) != a_before


def test_malformed_requests_fail_fast_naming_the_field_and_the_server_keeps_serving(served, service, tokenizer):
    client = service.create_lora_training_client(base_model=NAME, rank=2, seed=6).result(timeout=60)
    ids = tokenizer.encode("a malformed datum")
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:-2]})
    start = time.time()
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.target_tokens has"):
        client.forward_backward([short], "cross_entropy").result(timeout=30)
    missing = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.logprobs is missing"):
        client.forward_backward([missing], "ppo").result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'gspo' is not served"):
        client.forward_backward([missing], "gspo").result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="base_model 'no-such-model' is not served"):
        service.create_lora_training_client(base_model="no-such-model", rank=2).result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank"):
        service.create_lora_training_client(base_model=NAME, rank=-1).result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="lora_config.train_attn is False with rank 0"):
        service.create_lora_training_client(base_model=NAME, rank=0, train_attn=False).result(timeout=30)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="over the model's context"):
        sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=100_000)).result(timeout=30)
    assert time.time() - start < 10  # refused at the door, no retries, no hang
    import httpx  # what the SDK never sends: no tml- key, a body that is not JSON, an endpoint not served
    assert httpx.post(f"{served.url}/api/v1/optim_step", content=b"{}", headers={"X-API-Key": "sk-x"}).status_code == 401
    refused = httpx.post(f"{served.url}/api/v1/optim_step", content=b"not json", headers={"X-API-Key": "tml-x"})
    assert refused.status_code == 400 and refused.json()["field"] == "body"
    refused = httpx.get(f"{served.url}/api/v1/training_runs", headers={"X-API-Key": "tml-x"})
    assert refused.status_code == 404 and "/api/v1/training_runs is not served" in refused.json()["error"]
    # refused by the job itself: the API's failed future, naming what is wrong
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(tinker.RequestFailedError, match="no such checkpoint"):
            client.load_state(f"tinker://{client.model_id}/weights/never-saved").result(timeout=30)
    nan = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "logprobs": [0.0] * (len(ids) - 1), "advantages": [math.nan] * (len(ids) - 1)})
    with pytest.raises(tinker.RequestFailedError, match="non-finite loss"):
        client.forward_backward([nan], "importance_sampling").result(timeout=30)
    # and the same client trains on
    out = step(client, [sft_datum(tokenizer, "a well-formed datum")])
    assert math.isfinite(out.metrics["loss:sum"])
    rest = tinker.RestClient(base_url=served.url, api_key="tml-local-test")
    models = rest.get_server_capabilities().result(timeout=30).supported_models
    assert [m.model_name for m in models] == [NAME]


def test_plait_serve_speaks_tinker_under_the_name_it_is_given(served, tmp_path, capsys):
    import threading

    from plait.cli import main
    from plait.serving.serve import serve
    assert main(["serve", served.gateway.tokenizer.name_or_path, "--tinker-batch-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--tinker-batch-tokens" in err and "a number of tokens >= 1" in err and "Traceback" not in err, err
    urls, stop = [], threading.Event()
    thread = threading.Thread(target=serve, args=(served.gateway.tokenizer.name_or_path,), daemon=True,
                              kwargs=dict(port=0, name="my-model", tinker_dir=str(tmp_path), ready=urls.append, stop=stop))
    thread.start()
    try:
        deadline = time.time() + 60
        while not urls and thread.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        service = tinker.ServiceClient(base_url=urls[0], api_key="tml-cli")
        client = service.create_lora_training_client(base_model="my-model", rank=2).result(timeout=60)
        assert client.save_state("s").result(timeout=60).path.endswith("/weights/s")
        assert any(p.name == "state.pt" for p in tmp_path.rglob("*"))
        service.close("success").result(timeout=30)
    finally:
        stop.set()
        thread.join(timeout=30)


def test_a_sessions_requests_are_on_the_timeline_in_the_report_and_in_its_exported_trace(served, tokenizer):
    import gzip
    import json

    import httpx

    from plait.profiler.analysis.report import build_report
    from plait.profiler.timeline import TIMELINE, read_timeline
    service = tinker.ServiceClient(base_url=served.url, api_key="tml-trace")
    client = service.create_lora_training_client(base_model=NAME, rank=2, seed=9).result(timeout=60)
    step(client, [sft_datum(tokenizer, "traced")])
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    sampler.sample(types.ModelInput.from_ints(tokenizer.encode("tr")), 1, types.SamplingParams(max_tokens=4)).result(timeout=60)
    session = client.model_id.split(":")[0]
    spans = [s for s in read_timeline(TIMELINE.path) if str(s.get("session", "")).startswith(session + ":")]
    stages = {s["stage"] for s in spans}
    assert {"queue", "create", "forward_backward", "optim_step", "sampler_from_client", "sample", "load_weights"} <= stages, \
        stages  # load_weights: the engine takes the new sampler's merged weights, inside its sample
    assert {s["session"] for s in spans} == {client.model_id, sampler._sampling_session_id}
    assert all(s["role"] == "tinker" and s["end"] >= s["start"] for s in spans)
    # the SDK's export_session_trace: a URL that a plain GET (no API key) downloads, a Chrome trace of the session
    url = tinker.RestClient(base_url=served.url, api_key="tml-trace").export_session_trace(session).result(timeout=60)
    trace = json.loads(gzip.decompress(httpx.get(url).raise_for_status().content))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["name"] for e in events} == stages
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert any(client.model_id in lane for lane in lanes), lanes
    other = tinker.RestClient(base_url=served.url, api_key="tml-trace").export_session_trace("plait-none")
    with pytest.raises(RuntimeError, match="no requests"):
        other.result(timeout=30)
    # `plait profile report` on the server's output folder shows the Tinker stages
    text = build_report(os.path.dirname(TIMELINE.path))
    page = open(os.path.join(os.path.dirname(TIMELINE.path), "report", "index.html")).read()
    assert "Served requests" in page and client.model_id in page and "optim_step" in page
    assert re.search(r"served requests \(\d+ clients\): .*forward_backward \d+ x", text), text
    service.close("success").result(timeout=30)


def test_the_verdict_for_a_session_names_samples_awaited_one_by_one_and_a_loop_that_leaves_the_server_idle(served,
                                                                                                       tokenizer):
    """The served-session verdict (profiler/analysis/served.py) on loops written with the real SDK: four samples each
    awaited before the next is sent are `samples_one_by_one`, the same four submitted together are not; a loop that
    spends its time between requests (here asleep) is `loop_between_requests`, and `plait profile report` prints it."""
    from plait.profiler.analysis import served as served_verdict
    from plait.profiler.analysis.report import build_report
    from plait.profiler.timeline import TIMELINE, read_timeline
    prompts = [types.ModelInput.from_ints(tokenizer.encode(text)) for text in ("ab", "cde", "fg", "hij")]
    params = types.SamplingParams(max_tokens=8)

    def session_of(loop) -> served_verdict.Session:
        service = tinker.ServiceClient(base_url=served.url, api_key="tml-verdict")
        client = service.create_lora_training_client(base_model=NAME, rank=2, seed=41).result(timeout=60)
        loop(client)
        service.close("success").result(timeout=30)
        TIMELINE.flush(0)
        sid = client.model_id.split(":")[0]
        return next(s for s in served_verdict.sessions(read_timeline(TIMELINE.path)) if s.id == sid)

    def one_by_one(client):
        sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
        for p in prompts:
            sampler.sample(p, 2, params).result(timeout=60)

    def together(client):
        sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
        for future in [sampler.sample(p, 2, params) for p in prompts]:
            future.result(timeout=60)

    def asleep(client):
        for _ in range(3):
            step(client, [sft_datum(tokenizer, "idle server")])
            time.sleep(0.3)  # the loop's own work between steps

    serial = served_verdict.samples_one_by_one(session_of(one_by_one))
    assert serial is not None and len(serial.inputs["calls_s"]) == 4 and 0 < serial.saving < serial.share
    assert served_verdict.samples_one_by_one(session_of(together)) is None
    idle = served_verdict.loop_between_requests(session_of(asleep))
    assert idle is not None and idle.share > 0.5 and "optim_step" in idle.driver
    text = build_report(os.path.dirname(TIMELINE.path))
    assert "verdict: the client loop between requests is" in text or "verdict: sample calls awaited one by one" in text


def test_plait_export_writes_a_tinker_checkpoint_as_a_merged_model_and_as_the_adapter(served, service, tokenizer,
                                                                                       tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from plait.cli import main
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=12).result(timeout=60)  # head too
    data = [sft_datum(tokenizer, "export me")]
    for _ in range(2):
        step(client, data)
    path = client.save_state("exported").result(timeout=60).path
    served_logprobs = torch.tensor(forward_logprobs(client, data)[0])
    ids = [*data[0].model_input.to_ints(), data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    root = served.tinker.trainer.root
    assert main(["export", path, str(tmp_path / "merged"), "--tinker-dir", root]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logprobs(merged), served_logprobs, atol=1e-4)
    assert os.path.isfile(tmp_path / "merged" / "tokenizer.json") or os.path.isfile(tmp_path / "merged" / "tokenizer_config.json")
    # the checkpoint's folder itself, as the peft adapter over the served model
    folder = served.tinker.trainer.folder(path)
    assert main(["export", folder, str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served.tinker.trainer.path), tmp_path / "adapter")
    assert torch.allclose(logprobs(adapted), served_logprobs, atol=1e-4)
    # a tinker:// path that is not there: one line naming it, exit 2
    assert main(["export", f"tinker://{client.model_id}/weights/nope", str(tmp_path / "x"), "--tinker-dir", root]) == 2


def test_rank_0_fine_tunes_every_weight_of_its_own_copy_and_saves_loads_samples_and_exports(served, service, tokenizer,
                                                                                             tmp_path):
    from transformers import AutoModelForCausalLM

    from plait.cli import main
    data = [sft_datum(tokenizer, "every weight learns this")]
    ids = types.ModelInput.from_ints([*data[0].model_input.to_ints(), data[0].loss_fn_inputs["target_tokens"].tolist()[-1]])
    base = service.create_sampling_client(base_model=NAME).result(timeout=60)
    base_before = base.compute_logprobs(ids).result(timeout=60)
    client = service.create_lora_training_client(base_model=NAME, rank=0).result(timeout=60)
    assert client.get_info().is_lora is False
    own = served.tinker.trainer.clients[client.model_id].model
    before = {n: p.detach().clone() for n, p in own.named_parameters()}
    losses = [step(client, data, lr=1e-3).metrics["loss:sum"] for _ in range(3)]
    assert losses[0] > losses[1] > losses[2], losses
    changed = {n for n, p in own.named_parameters() if not torch.equal(p, before[n])}
    assert "model.embed_tokens.weight" in changed and not any("lora" in n for n in before)  # base weights, no adapter
    assert any(".mlp." in n for n in changed) and any(".self_attn." in n for n in changed)
    assert base.compute_logprobs(ids).result(timeout=60) == base_before  # the shared base model did not move
    # its sampler is a frozen copy of all its weights: on-policy with the trainer's forward
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    trained = forward_logprobs(client, data)[0]
    assert torch.allclose(torch.tensor(sampler.compute_logprobs(ids).result(timeout=60)[1:]), torch.tensor(trained),
                          atol=1e-3)
    # save_state / load_state with the optimizer round-trips the loss exactly
    path = client.save_state("full").result(timeout=60).path
    at_save = client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    step(client, data, lr=1e-3)
    assert client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] != at_save
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state_with_optimizer(path).result(timeout=60)
    assert client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == at_save
    from_path = service.create_sampling_client(model_path=path).result(timeout=60)
    assert torch.allclose(torch.tensor(from_path.compute_logprobs(ids).result(timeout=60)[1:]), torch.tensor(trained),
                          atol=1e-3)
    # plait export: a Hugging Face folder with those weights; no adapter to export
    root = served.tinker.trainer.root
    assert main(["export", path, str(tmp_path / "full"), "--tinker-dir", root]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    with torch.no_grad():
        logp = torch.log_softmax(exported(input_ids=torch.tensor([ids.to_ints()])).logits[0, :-1], -1)
    logp = logp.gather(-1, torch.tensor(ids.to_ints()[1:])[:, None])[:, 0]
    assert torch.allclose(logp, torch.tensor(trained), atol=1e-4)
    assert main(["export", path, str(tmp_path / "adapter"), "--tinker-dir", root, "--lora", "adapter"]) == 2
    # each full sampler is a model copy: a client keeps its newest two; an older one says its weights were dropped
    newest = [client.save_weights_and_get_sampling_client().result(timeout=60) for _ in range(2)]
    assert newest[0].compute_logprobs(ids).result(timeout=60)[1:] == pytest.approx(trained, abs=1e-3)
    with pytest.raises(tinker.RequestFailedError, match="weights were dropped"):
        sampler.compute_logprobs(ids).result(timeout=60)


def test_concurrent_samples_of_one_sampler_are_one_engine_call_each_with_its_own_answer(served, service, tokenizer):
    """The SDK sends a batch's prompts as concurrent requests: those queued together (same sampler, same unseeded
    params) are one engine call, each answered with its own prompt's samples and their log-probs."""
    import threading
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=5).result(timeout=60)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    release, blocked = threading.Event(), concurrent.futures.Future()
    served.tinker.jobs.put((blocked, lambda: release.wait(60), (), "blocker", time.perf_counter(), None))
    prompts = [tokenizer.encode(text) for text in ("ab", "cde", "fghi")]
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, types.SamplingParams(max_tokens=6)) for p in prompts]
    deadline = time.time() + 30
    while served.tinker.jobs.qsize() < len(prompts) and time.time() < deadline:
        time.sleep(0.01)
    release.set()
    results = [future.result(timeout=60) for future in futures]
    assert engine_calls(sampler) == 1  # three requests, one engine call
    for prompt, result in zip(prompts, results):
        assert len(result.sequences) == 2
        for seq in result.sequences:
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result(timeout=60)
            assert torch.allclose(torch.tensor(scored[len(prompt):]), torch.tensor(seq.logprobs), atol=1e-3)


def rl_datum(tokenizer, text: str, advantage: float) -> types.Datum:
    ids = tokenizer.encode(text)
    n = len(ids) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "logprobs": [-1.0] * n, "advantages": [advantage] * n})


def grads(served, client) -> dict[str, torch.Tensor | None]:
    params = served.tinker.trainer.clients[client.model_id].params
    return {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}


@pytest.mark.parametrize("rank", [4, 0])
def test_a_request_past_the_token_budget_runs_in_pieces_with_the_same_outputs_and_gradients(served, service, tokenizer,
                                                                                           monkeypatch, rank):
    """`--tinker-batch-tokens`: a forward_backward larger than the budget runs in pieces whose gradients add up to
    the whole request's (and the per-datum outputs and loss sum are the whole pass's)."""
    from plait.serving.tinker.trainer import micro_batches
    trainer = served.tinker.trainer
    data = [rl_datum(tokenizer, text, adv) for text, adv in
            [("one short", 1.0), ("a somewhat longer datum here", -0.5), ("mid size one", 2.0), ("xyz", 0.3),
             ("the longest datum of this request by far", -1.0)]]
    lengths = [len(d.model_input.to_ints()) for d in data]
    budget = max(lengths)
    assert len(micro_batches(lengths, budget)) >= 3  # the split really happens
    outs = {}
    for name, tokens in (("whole", 10 ** 6), ("split", budget)):
        client = service.create_lora_training_client(base_model=NAME, rank=rank, seed=21).result(timeout=60)
        monkeypatch.setattr(trainer, "batch_tokens", tokens)
        out = client.forward_backward(data, "importance_sampling").result(timeout=60)
        fwd = client.forward(data, "importance_sampling").result(timeout=60)
        outs[name] = (out, fwd, grads(served, client))
    (whole, whole_fwd, whole_grads), (split, split_fwd, split_grads) = outs["whole"], outs["split"]
    assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], abs=1e-6)
    for a, b in [*zip(whole.loss_fn_outputs, split.loss_fn_outputs), *zip(whole_fwd.loss_fn_outputs, split_fwd.loss_fn_outputs)]:
        for key in ("logprobs", "elementwise_loss"):
            assert torch.allclose(a[key].to_torch(), b[key].to_torch(), atol=1e-6, rtol=0)
    assert whole_grads.keys() == split_grads.keys() and all(g is not None for g in whole_grads.values())
    for name, g in whole_grads.items():
        assert torch.allclose(g, split_grads[name], atol=1e-6, rtol=0), name
    # the pieces take the data shortest first; each datum's outputs are still its own, in the request's order
    assert micro_batches([5, 3, 9, 3], 12) == [[1, 3], [0], [2]]
    alone = [client.forward([d], "importance_sampling").result(timeout=60).loss_fn_outputs[0] for d in data]
    for a, b in zip(alone, whole_fwd.loss_fn_outputs):
        assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5, rtol=0)


def test_a_non_finite_loss_in_a_later_piece_leaves_the_gradients_as_before_the_request(served, service, tokenizer,
                                                                                       monkeypatch):
    """The non-finite-loss guard over pieces: the good piece's backward has run when the bad one is found; the
    request fails naming the loss, the gradients are those from before it, and the client trains on."""
    from plait.serving.tinker.trainer import micro_batches
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=22).result(timeout=60)
    good = rl_datum(tokenizer, "a good datum", 1.0)
    client.forward_backward([good], "importance_sampling").result(timeout=60)
    before = grads(served, client)
    bad = rl_datum(tokenizer, "a bad datum!", math.nan)
    n = len(good.model_input.to_ints())
    monkeypatch.setattr(served.tinker.trainer, "batch_tokens", n)
    assert micro_batches([n, len(bad.model_input.to_ints())], n) == [[0], [1]]  # good first, then bad
    with pytest.raises(tinker.RequestFailedError, match="importance_sampling gave a non-finite loss"):
        client.forward_backward([good, bad], "importance_sampling").result(timeout=60)
    after = grads(served, client)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the same client trains on: its gradients are the first request's plus this one's
    out = step(client, [good], loss_fn="importance_sampling")
    assert math.isfinite(out.metrics["loss:sum"])


def test_samples_that_arrive_while_the_first_waits_for_more_are_one_engine_call(served, service, tokenizer, monkeypatch):
    """The SDK's concurrent sample requests reach the server some ms apart: a sample waits GATHER_S after the last
    one of its kind for more (here long, so the test waits on the queue, never on the clock), then all are one
    engine call."""
    from plait.serving.tinker import routes
    monkeypatch.setattr(routes, "GATHER_S", 60.0)
    monkeypatch.setattr(routes, "GATHER_MAX_S", 120.0)
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=23).result(timeout=60)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    jobs = served.tinker.jobs
    futures, put = [], jobs.unfinished_tasks  # every job put counts (nothing calls task_done)
    for text in ("ab", "cde"):
        futures.append(sampler.sample(types.ModelInput.from_ints(tokenizer.encode(text)), 2, types.SamplingParams(max_tokens=4)))
        put += 1
        deadline = time.time() + 30
        while not (jobs.unfinished_tasks == put and jobs.qsize() == 0) and time.time() < deadline:
            time.sleep(0.01)  # until the worker has taken it: the first is waiting for more when the second comes
    done = concurrent.futures.Future()
    jobs.put((done, lambda: None, (), "another job", time.perf_counter(), None))  # ends the wait
    results = [future.result(timeout=60) for future in futures]
    assert [len(r.sequences) for r in results] == [2, 2]
    assert engine_calls(sampler) == 1


def engine_calls(sampler) -> int:
    """The engine calls a sampler's sample requests went through (requests sampled together share one span)."""
    from plait.profiler.timeline import TIMELINE, read_timeline
    TIMELINE.flush(0)
    return len({(s["start"], s["end"]) for s in read_timeline(TIMELINE.path)
                if s["stage"] == "sample" and str(s.get("session")) == sampler._sampling_session_id})  # noqa: SLF001


def test_a_new_samplers_burst_as_large_as_the_clients_first_burst_starts_without_waiting_for_more(served, service,
                                                                                                  tokenizer, monkeypatch):
    """An RL loop sends each step's sampler the same number of prompts: once a sampler of the client had a burst of
    two, a later sampler's two requests are one engine call that starts when the second arrives, not GATHER_S after
    (here 60 s, so the old wait would outlast the result's timeout)."""
    from plait.serving.tinker import routes
    monkeypatch.setattr(routes, "GATHER_S", 60.0)
    monkeypatch.setattr(routes, "GATHER_MAX_S", 120.0)
    client = service.create_lora_training_client(base_model=NAME, rank=4, seed=26).result(timeout=60)
    params = types.SamplingParams(max_tokens=4)
    prompts = [types.ModelInput.from_ints(tokenizer.encode(text)) for text in ("ab", "cde")]
    first = client.save_weights_and_get_sampling_client().result(timeout=60)
    futures = [first.sample(p, 2, params) for p in prompts]
    jobs = served.tinker.jobs
    deadline = time.time() + 30
    while getattr(served.tinker.bursts.get(first._sampling_session_id), "asked", 0) < 2 and time.time() < deadline:  # noqa: SLF001
        time.sleep(0.01)  # both submitted: the worker holds them, waiting for more
    jobs.put((concurrent.futures.Future(), lambda: None, (), "another job", time.perf_counter(), None))  # ends that wait
    assert [len(f.result(timeout=60).sequences) for f in futures] == [2, 2]
    assert served.tinker.expected[client.model_id] == 2
    second = client.save_weights_and_get_sampling_client().result(timeout=60)
    results = [f.result(timeout=30) for f in [second.sample(p, 2, params) for p in prompts]]  # no other job comes
    assert [len(r.sequences) for r in results] == [2, 2]
    assert engine_calls(second) == 1


def test_a_full_fine_tuning_sampler_keeps_its_weights_while_its_client_trains_and_other_samplers_load(served, service,
                                                                                                     tokenizer):
    """The engine takes a sampler's weights without copying them (share): what it holds must be the sampler's own
    frozen copy, never the client's live weights, so training on does not move a sampler the engine holds."""
    client = service.create_lora_training_client(base_model=NAME, rank=0, seed=24).result(timeout=60)
    data = [sft_datum(tokenizer, "frozen samplers")]
    step(client, data, lr=1e-3)
    first = client.save_weights_and_get_sampling_client().result(timeout=60)
    ids = types.ModelInput.from_ints(tokenizer.encode("frozen samplers"))
    held = first.compute_logprobs(ids).result(timeout=60)  # the engine holds `first` now
    step(client, data, lr=1e-2)
    assert first.compute_logprobs(ids).result(timeout=60) == held  # still held, not reloaded, not moved
    second = client.save_weights_and_get_sampling_client().result(timeout=60)
    assert second.compute_logprobs(ids).result(timeout=60)[1:] != pytest.approx(held[1:], abs=1e-5)
    assert first.compute_logprobs(ids).result(timeout=60) == held  # loaded again after `second`


def test_lora_samplers_are_frozen_tensors_not_adapters_so_the_model_does_not_grow_with_every_step(served, service,
                                                                                                   tokenizer):
    """An RL loop makes a sampler every step: each is a frozen copy of its client's adapter tensors, merged into the
    engine through one adapter per LoRA shape, so the served model keeps one adapter per client (every adapter in
    it was on every request's path: a loop slowed down with each step). Samplers of two shapes stay on-policy."""
    trainer = served.tinker.trainer
    clients = [service.create_lora_training_client(base_model=NAME, rank=rank, seed=25).result(timeout=60)
               for rank in (4, 2)]
    data = [sft_datum(tokenizer, "samplers of two shapes")]
    ids = types.ModelInput.from_ints(tokenizer.encode("samplers of two shapes"))
    before = None
    for _ in range(3):
        for client in clients:
            step(client, data, lr=1e-2)
            sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
            scored = sampler.compute_logprobs(ids).result(timeout=60)[1:]
            assert torch.allclose(torch.tensor(scored), torch.tensor(forward_logprobs(client, data)[0]), atol=1e-3)
        adapters = len(trainer.peft.peft_config)
        assert before is None or adapters == before  # no adapter per sampler
        before = adapters


def test_a_lora_client_keeps_its_newest_samplers_and_an_older_one_says_its_weights_were_dropped(served, service,
                                                                                                 tokenizer, monkeypatch):
    """A sampler a step holds a copy of its client's adapter: a LoRA client keeps its newest KEPT_LORA_SNAPSHOTS, so a
    long RL loop's memory stays bounded; an older sampler answers a 400 saying so, and the newest still samples."""
    from plait.serving.tinker import trainer as module
    monkeypatch.setattr(module, "KEPT_LORA_SNAPSHOTS", 3)
    trainer = served.tinker.trainer
    client = service.create_lora_training_client(base_model=NAME, rank=2, seed=31).result(timeout=60)
    ids = types.ModelInput.from_ints(tokenizer.encode("bounded samplers"))
    samplers = [client.save_weights_and_get_sampling_client().result(timeout=60) for _ in range(5)]
    live = [k for k, v in trainer.snapshots.items() if v is not None]
    mine = trainer.clients[next(m for m, c in trainer.clients.items() if c.lora.seed == 31)].snapshots
    assert len(mine) == 3 and set(mine) <= set(live)
    assert len(samplers[-1].compute_logprobs(ids).result(timeout=60)) == len(ids.to_ints())
    with pytest.raises(tinker.RequestFailedError, match="weights were dropped: a LoRA client keeps its newest 3"):
        samplers[0].compute_logprobs(ids).result(timeout=60)
