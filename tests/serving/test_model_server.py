"""ModelServer (what `plait serve` and a judge's replica run) over a real tiny model (built from a config), asked
by the clients verl's reward functions use: aiohttp posting SGLang's token-level /generate (FAPO's
reward_fn_reasoning) and chat completions (the openai SDK). A judge's determinism as verl#7027 asks: a seeded
request gets the same answer alone and amid other requests."""

import asyncio

import aiohttp
import openai
import pytest

from plait.config import RolloutConfig
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
from plait.profiler.session import ProfilerSession
from plait.serving.serve import ModelServer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from plait.models import create_tiny_model
    return create_tiny_model(tmp_path_factory.mktemp("served") / "m", size="xs", seed=5)


def server(path, **kwargs) -> ModelServer:
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    return ModelServer(path, RolloutConfig(name="hf"), profiler, name="judge", **kwargs)


async def post(address: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{address}/{path}", json=body) as resp:
            return resp.status, await resp.json()


def test_generate_answers_as_sglang_and_clamps_to_the_context(model_dir):
    s = server(model_dir, max_tokens=6, context=40, defaults={"temperature": 0.0})
    try:
        tok = s.gateway.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": "is 2+2=4?"}], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        status, out = asyncio.run(post(s.address, "generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 16384}}))
        assert status == 200 and set(out) == {"text", "output_ids", "meta_info"}
        assert len(out["output_ids"]) <= 40 - len(ids) and out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        status, default = asyncio.run(post(s.address, "generate", {"input_ids": ids}))  # temperature 0 by default here
        assert status == 200 and default["output_ids"] == out["output_ids"][:len(default["output_ids"])]
        assert len(default["output_ids"]) <= 6  # the server's default budget (a judge's response_length)
        status, two = asyncio.run(post(s.address, "generate", {"text": "2+2=", "return_logprob": True, "sampling_params": {
            "n": 2, "sampling_seed": 7, "temperature": 1.0, "max_new_tokens": 5}}))
        assert status == 200 and isinstance(two, list) and len(two) == 2 and two[0]["output_ids"] != two[1]["output_ids"]
        logprobs = two[0]["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in logprobs] == two[0]["output_ids"] and all(lp <= 0 for lp, _, _ in logprobs)
        for body, field in (({"input_ids": ids, "stream": True}, "stream"), ({"text": "x", "image_data": ["a.png"]}, "image_data"),
                            ({"input_ids": ids, "sampling_params": {"min_new_tokens": 3}}, "min_new_tokens"),
                            ({"sampling_params": {}}, "input_ids"), ({"input_ids": list(range(41))}, "messages")):
            status, err = asyncio.run(post(s.address, "generate", body))
            assert status == 400 and err["error"]["param"] == field, (body, err)
        chat = openai.OpenAI(base_url=s.url + "/v1", api_key="none").chat.completions.create(
            model="any-name", messages=[{"role": "user", "content": "is 2+2=4?"}], max_tokens=16384)
        assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens <= 40 - len(ids)
    finally:
        s.close()


async def ask_at_once(address: str, prompts: list[str]) -> list[list[int]]:
    outs = await asyncio.gather(*(post(address, "generate", {"text": p, "sampling_params": {"max_new_tokens": 8}})
                                  for p in prompts))
    return [o["output_ids"] for _, o in outs]


def test_full_determinism_gives_a_request_the_same_verdict_alone_and_amid_others(model_dir):
    prompts = [f"{a}+{a}=" for a in range(12, 18)]
    # a 0.3 s window: the six requests share one take of the queue, as a judge's concurrent reward calls do
    s = server(model_dir, max_tokens=8, seed=42, window_s=0.3)  # a judge with full_determinism: seed + replica rank
    try:
        alone = [asyncio.run(ask_at_once(s.address, [p]))[0] for p in prompts[:2]]
        for _ in range(3):  # on a loaded machine the six may miss one window: asked again until they share a round
            before = len(s.rounds_since(0))
            together = asyncio.run(ask_at_once(s.address, prompts))
            if [r.requests for r in s.rounds_since(0)[before:]] == [len(prompts)]:
                break
        else:
            pytest.fail("the six requests never shared one engine round")
        assert together[:2] == alone
        assert len({tuple(t) for t in together}) > 1  # seeded, yet different prompts sample different answers
    finally:
        s.close()
    s = server(model_dir, max_tokens=8, window_s=0.3)  # unseeded: the round's one generator, batch-dependent draws
    try:
        again = [asyncio.run(ask_at_once(s.address, prompts)) for _ in range(2)]
        assert again[0] != again[1]
        status, a = asyncio.run(post(s.address, "generate", {"text": prompts[0], "sampling_params": {"seed": 3}}))
        status, b = asyncio.run(post(s.address, "generate", {"text": prompts[0], "sampling_params": {"seed": 3}}))
        assert a["output_ids"] == b["output_ids"]  # a request's own seed, without the server's
    finally:
        s.close()


def test_the_shipped_fapo_style_reward_asks_a_served_judge(model_dir):
    """plait/configs/rewards/gsm8k_judge.py (the smollm2_gsm8k_judge preset's reward) with a tiny judge: a right
    training answer is judged (its verdict parsed or not, never an error), a wrong one and a validation row are
    scored by the rule alone, without a request."""
    import importlib.util

    from transformers import AutoTokenizer

    from plait.configtree import shipped_tool_config
    spec = importlib.util.spec_from_file_location("gsm8k_judge", shipped_tool_config("gsm8k_judge", "rewards", ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    s = server(model_dir, max_tokens=8, defaults={"temperature": 0.0})
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        info = {"split": "train", "question": "Tom has 2 apples and buys 3. How many?"}
        score = lambda solution, extra: asyncio.run(module.compute_score(  # noqa: E731
            "gsm8k_synthetic", solution, "5", extra, s.address, tok))
        right = score("2 + 3 = 5. #### 5", info)
        assert right["acc"] == 1.0 and right["judged"] == 1.0 and right["score"] in (0.0, 1.0)
        assert right["score"] == 1.0 - right["flawed_positive"]
        before = len(s.rounds)
        assert score("2 + 3 = 6. #### 6", info)["judged"] == 0.0
        assert score("2 + 3 = 5. #### 5", {**info, "split": "test"})["judged"] == 0.0
        assert len(s.rounds) == before
    finally:
        s.close()
