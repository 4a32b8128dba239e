"""`plait train` through the gateway: outside agents written against the `openai` SDK (a function, a command) and
a third-party framework (OpenAI's Agents SDK) train the demo's tiny model in sync and fully_async (partial
rollout), on the local and the Ray backend, with the hf engine and vLLM. The agent rewrites its history
after its first call, so every session is two chains; the trained tokens are the sampled ones
(training/rollout_probs_diff_max at float32 noise)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.trainers.lifecycle import read_metrics

REPO = Path(__file__).resolve().parents[2]

REWRITING_AGENT = '''
import openai

async def run(row, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(model="m", messages=row["messages"])
    compacted = [{"role": "system", "content": "again:"}, *row["messages"]]  # a rewritten history: a new chain
    await client.chat.completions.create(model="m", messages=compacted)
    if row["index"] % 8 == 5:
        raise RuntimeError("this agent gives up on row " + str(row["index"]))
'''

COMMAND_AGENT = '''
import json, sys
import openai
row = json.loads(sys.stdin.readline())
client = openai.OpenAI()
client.chat.completions.create(model="m", messages=row["messages"])
client.chat.completions.create(model="m", messages=[{"role": "system", "content": "again:"}, *row["messages"]])
'''

AGENTS_SDK = '''
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)


async def run(row, base_url, api_key):
    model = OpenAIChatCompletionsModel(model="plait", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    agent = Agent(name="arithmetic", instructions="Answer with the number.", model=model)
    result = await Runner.run(agent, row["messages"][-1]["content"])
    return 1.0 if str(row["ground_truth"]) in str(result.final_output) else 0.0
'''

RESPONSES_AGENT = '''
import openai

async def run(row, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    first = await client.responses.create(model="m", input=row["messages"], max_output_tokens=3)
    async with client.responses.stream(model="m", previous_response_id=first.id, input="again:",
                                       max_output_tokens=3) as stream:
        last = [event.type async for event in stream][-1]
    assert last in ("response.completed", "response.incomplete"), last  # incomplete: the chain's budget cut it
'''

TINY = ["demo.model_size=xs", "demo.warmstart_steps=0", "data.train_size=64", "data.val_size=8",
        "data.train_batch_size=4", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=3", "trainer.test_freq=2", "trainer.logger=[console,file]",
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent"]
RAY = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5"]
FULLY_ASYNC = ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.partial_rollout=True",
               "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1"]


def train(tmp_path: Path, agent: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY, *agent,
           f"trainer.default_local_dir={tmp_path / 'run'}", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "agent/sessions" in r]


def per_sample(tmp_path: Path) -> dict[str, set[str]]:
    spans: dict[str, set[str]] = {}
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        spans.setdefault(row["sample"], set()).add(row["span"])
    return spans


def agent_keys(tmp_path: Path, form: str) -> list[str]:
    key = "actor_rollout_ref.rollout.agent.openai_agent"
    if form == "command":
        (tmp_path / "agent_cli.py").write_text(textwrap.dedent(COMMAND_AGENT))
        return [f"{key}.command={sys.executable} {tmp_path / 'agent_cli.py'}"]
    (tmp_path / "agent.py").write_text(REWRITING_AGENT)
    return [f"{key}.path={tmp_path / 'agent.py'}"]


@pytest.mark.parametrize("mode,form", [("sync", "function"), ("fully_async", "command"), ("fully_async_ray", "function")])
def test_an_openai_sdk_agent_trains_through_the_gateway(tmp_path, mode, form):
    extra = {"sync": [], "fully_async": FULLY_ASYNC, "fully_async_ray": [*RAY, *FULLY_ASYNC]}[mode]
    proc, steps = train(tmp_path, agent_keys(tmp_path, form), *extra)
    assert len(steps) == 3
    for r in steps:
        assert r["agent/sessions"] >= 8 and r["agent/chains_per_session"] == 2.0 and r["agent/requests_per_session"] == 2
        assert r["training/rollout_probs_diff_max"] <= 1e-5
        assert r["tokens/generated"] == r["tokens/trained"] + r["tokens/discarded"] and r["tokens/trained"] > 0
    spans = per_sample(tmp_path)  # samples.jsonl: each session's calls and the agent's time between them
    trained = [kinds for kinds in spans.values() if "consumed" in kinds]
    assert trained and all({"request_queue", "agent", "reward"} <= kinds and ({"prefill", "decode"} <= kinds
                                                                             or "gen" in kinds) for kinds in trained)
    if form == "function":  # row 5 (and 13, ...) fails: its sample, not the step
        failed = [r["agent/failed_sessions"] for r in steps]
        assert all(f < r["agent/sessions"] for f, r in zip(failed, steps))
        if any(failed):
            assert "agent sessions failed, each masked out of the loss" in proc.stderr
            assert "raised RuntimeError: this agent gives up on row" in proc.stderr


def test_a_third_party_agent_framework_trains_unchanged(tmp_path):
    """OpenAI's Agents SDK (openai-agents), its code as written for OpenAI but for the base URL and key."""
    pytest.importorskip("agents")
    (tmp_path / "agent.py").write_text(AGENTS_SDK)
    _, steps = train(tmp_path, [f"actor_rollout_ref.rollout.agent.openai_agent.path={tmp_path / 'agent.py'}"])
    assert len(steps) == 3 and all(r["agent/failed_sessions"] == 0 and r["agent/requests_per_session"] >= 1
                                   for r in steps)
    assert all(r["training/rollout_probs_diff_max"] <= 1e-5 for r in steps)


def test_an_agent_on_the_responses_api_trains_through_the_gateway(tmp_path):
    """The Responses API in training: a call, then a streamed one continuing it by previous_response_id (the first
    answer cut by max_output_tokens, so its turn is closed before the next message): one chain per session, whose
    trained tokens are the sampled ones."""
    (tmp_path / "agent.py").write_text(RESPONSES_AGENT)
    _, steps = train(tmp_path, [f"actor_rollout_ref.rollout.agent.openai_agent.path={tmp_path / 'agent.py'}"],
                     "data.max_response_length=32")  # room for the closed turn and the user's message between the two
    assert len(steps) == 3
    for r in steps:
        assert r["agent/failed_sessions"] == 0 and r["agent/requests_per_session"] == 2
        assert r["agent/chains_per_session"] == 1.0 and r["training/rollout_probs_diff_max"] <= 1e-5


VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.max_model_len=512"]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_an_openai_sdk_agent_trains_through_the_gateway_on_vllm(tmp_path, mode, vllm_model_path):
    pytest.importorskip("vllm")
    _, steps = train(tmp_path, agent_keys(tmp_path, "function"), *VLLM, f"actor_rollout_ref.model.path={vllm_model_path}",
                     *({"sync": [], "fully_async": FULLY_ASYNC}[mode]))
    assert len(steps) == 3 and all(r["agent/chains_per_session"] == 2.0 for r in steps)


CONSTRAINED_AGENT = '''
import openai

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}


async def run(row, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(model="m", messages=row["messages"], tool_choice="required",
                                         tools=[{"type": "function", "function": {"name": "add", "parameters": ADD}}])
    await client.chat.completions.create(model="m", messages=row["messages"], response_format={"type": "json_object"})
'''


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_constrained_agent_trains_through_the_gateway_on_vllm(tmp_path, mode, vllm_model_path):
    """Forced calls and JSON answers on vLLM in training: the trainer's log-probs over the replayed grammar's allowed
    set are the engine's (rollout_probs_diff_max at float32 noise) and the constrained tokens are counted; with
    partial rollout a cut constrained request resumes in its grammar (else its replay fails the session)."""
    pytest.importorskip("vllm")
    pytest.importorskip("llguidance")
    (tmp_path / "agent.py").write_text(CONSTRAINED_AGENT)
    _, steps = train(tmp_path, [f"actor_rollout_ref.rollout.agent.openai_agent.path={tmp_path / 'agent.py'}"], *VLLM,
                     f"actor_rollout_ref.model.path={vllm_model_path}", "trainer.total_training_steps=2",
                     "data.max_response_length=40", *({"sync": [], "fully_async": FULLY_ASYNC}[mode]))
    assert len(steps) == 2 and all(r["agent/constrained_tokens"] > 0 and r["agent/failed_sessions"] == 0 for r in steps)
    assert max(r["training/rollout_probs_diff_max"] for r in steps) < 1e-3


DEFAULT_CLIENT_AGENT = '''
import asyncio
import random
from agents import Agent, Runner, set_default_openai_api, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
set_default_openai_api("chat_completions")  # the tiny model's 6 tokens end a Response as incomplete, which the SDK raises on


async def run(row, base_url, api_key):
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=api_key))  # process-wide: the last one wins
    await asyncio.sleep(0.2)  # every session of the worker has set its client before any calls the model
    await Runner.run(Agent(name="arithmetic", instructions="Answer with the number.", model="plait"),
                     row["messages"][-1]["content"])
    return random.random()  # a spread of rewards: every group has a signal to train
'''


def test_a_process_wide_client_in_the_function_form_never_mixes_sessions(tmp_path):
    """openai-agents' `set_default_openai_client`, many sessions in one worker process: each call is trained in the
    session of the agent that made it, whichever session's key the last-set client carries."""
    pytest.importorskip("agents")
    (tmp_path / "agent.py").write_text(DEFAULT_CLIENT_AGENT)
    _, steps = train(tmp_path, [f"actor_rollout_ref.rollout.agent.openai_agent.path={tmp_path / 'agent.py'}"],
                     "trainer.total_training_steps=2")
    assert len(steps) == 2
    for r in steps:
        assert r["agent/failed_sessions"] == 0 and r["agent/sessions"] == 16
        assert r["agent/chains_per_session"] == 1.0 and r["agent/requests_per_session"] == 1
