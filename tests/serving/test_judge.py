"""A judge (verl's generative reward model): a tiny causal LM (built from a config) served by plait's server and
asked by an async reward function through `reward_router_address`, in both of verl's request styles (chat
completions as the FAPO remote recipe sends them, SGLang's token-level /generate as FAPO's reward_fn_reasoning
does), with `plait train` in sync and fully_async on the local and the Ray backend; its time is the step's
"judge" stage. Refusals: a causal LM without such a function, a function without verl's keywords."""

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from plait.trainers.lifecycle import read_metrics

REPO = Path(__file__).resolve().parents[2]

# What FAPO's reward function does (its prompt shape, the token-level request, the verdict in \boxed{}), plus a
# chat-completions request, and what it received: the address as host:port, the judge's tokenizer object.
JUDGE_REWARD = r'''
import aiohttp
from transformers import PreTrainedTokenizerBase

TEMPLATE = "[Problem] {problem}\n[Solution] {solution}\nIf the solution is wrong, name its first wrong step; else -1. Put it in \\boxed{{}}."


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    host, _, port = reward_router_address.rpartition(":")
    prompt = TEMPLATE.format(problem=extra_info.get("question", ""), solution=solution_str)
    ids = reward_model_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                     add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{reward_router_address}/generate",
                                json={"input_ids": ids, "sampling_params": {"temperature": 1.0}}) as resp:
            generated = await resp.json()
        async with session.post(f"http://{reward_router_address}/v1/chat/completions",
                                json={"model": "FAPO-GenRM", "messages": [{"role": "user", "content": prompt}],
                                      "max_tokens": 3}) as resp:
            chat = await resp.json()
    verdict = reward_model_tokenizer.decode(generated["output_ids"], skip_special_tokens=True)
    correct = float(solution_str.strip().startswith(str(ground_truth)))
    return {"score": correct - 0.5 * correct * ("-1" not in verdict),
            "host_port": float(host == "127.0.0.1" and port.isdigit() and "/" not in reward_router_address),
            "tokenizer": float(isinstance(reward_model_tokenizer, PreTrainedTokenizerBase)),
            "verdict_tokens": len(generated["output_ids"]),
            "verdict_decodes": float(verdict.strip() == generated["text"].strip()),
            "chat_tokens": chat["usage"]["completion_tokens"]}
'''

TINY = ["demo.model_size=xs", "demo.warmstart_steps=0", "data.train_size=64", "data.val_size=8",
        "data.train_batch_size=4", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console,file]", "reward.num_workers=2", "reward.reward_model.enable=true",
        "reward.reward_model.rollout.prompt_length=512", "reward.reward_model.rollout.response_length=5"]
RAY = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=2", "trainer.ray.cpus_per_worker=0.5"]
FULLY_ASYNC = ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.trigger_parameter_sync_step=1",
               "async_training.staleness_threshold=1"]
STANDALONE = ["reward.reward_model.enable_resource_pool=true", "reward.reward_model.nnodes=1",
              "reward.reward_model.n_gpus_per_node=1"]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from plait.models import create_tiny_model
    return create_tiny_model(tmp_path_factory.mktemp("judge") / "judge", size="xs", seed=3)


def train(tmp_path: Path, judge: str, *extra: str, reward: str = JUDGE_REWARD, check: bool = True):
    (tmp_path / "judge_reward.py").write_text(reward)
    cmd = [sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY, f"reward.reward_model.model_path={judge}",
           f"reward.custom_reward_function.path={tmp_path / 'judge_reward.py'}",
           f"trainer.default_local_dir={tmp_path / 'run'}", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("mode", ["sync", "fully_async", "sync_ray", "fully_async_ray_standalone"])
def test_a_judge_scores_through_reward_router_address(tmp_path, judge_dir, mode):
    profiled = ["global_profiler.tool=torch", "global_profiler.steps=[2]", "reward.reward_model.profiler.enable=true",
                f"global_profiler.save_path={tmp_path / 'profile'}"]  # the judge profiled as a role, locally
    extra = {"sync": profiled, "fully_async": FULLY_ASYNC, "sync_ray": RAY,
             "fully_async_ray_standalone": [*RAY, *FULLY_ASYNC, *STANDALONE]}[mode]
    proc = train(tmp_path, judge_dir, *extra)
    replicas = 2 if mode == "sync_ray" else 1  # colocated on Ray: one per train rank (verl's colocate mode)
    line = next(line for line in proc.stderr.splitlines() if line.startswith("plait: the judge"))
    assert f"{replicas} replica(s)" in line and line.count("127.0.0.1:") == replicas
    steps = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "timing_s/step" in r]
    assert len(steps) == 2
    for r in steps:  # every response asked the judge twice (one /generate, one chat call), as the reward's keys say
        assert r["reward_extra/host_port/mean"] == 1.0 and r["reward_extra/tokenizer/mean"] == 1.0
        # no max_new_tokens: the judge's response_length (5), the chat call's max_tokens 3 (fewer: a sampled EOS)
        assert 4 < r["reward_extra/verdict_tokens/mean"] <= 5 and 2 < r["reward_extra/chat_tokens/mean"] <= 3
        assert r["reward_extra/verdict_decodes/mean"] == 1.0
        # two requests a response: 16 responses a step (sync), a mini-batch's 8 a local update (fully_async)
        assert r["judge/requests"] == 2 * (8 if "async" in mode else 16) and 3 < r["judge/response_tokens/mean"] <= 4
        assert 0 < r["timing_s/judge"] <= r["timing_s/reward"]
    spans = [json.loads(line) for line in open(tmp_path / "run" / "timeline.jsonl")]
    judged = [s for s in spans if s["stage"] == "judge"]
    rewards = [s for s in spans if s["stage"] == "reward"]
    outside = [j for j in judged if not any(r["start"] <= j["start"] <= j["end"] <= r["end"] for r in rewards)]
    assert judged and not outside, (outside[:3], [(r["start"], r["end"]) for r in rewards])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "judge" in [t["stage"] for t in summary["top_stages"]] or len(summary["top_stages"]) == 4
    if mode == "sync":  # each engine round of the judge's thread is a reward_model/judge range of its trace
        [record] = [json.loads(line) for line in open(tmp_path / "profile" / "manifest.jsonl")]
        assert record["role"] == "reward_model" and record["complete"] and record["steps"] == [2, 2]
        trace = json.load(gzip.open(tmp_path / "profile" / record["path"]))
        assert any(e.get("name") == "reward_model/judge" for e in trace["traceEvents"])


def test_a_judge_without_verl_keywords_or_without_a_function_is_refused_in_one_line(tmp_path, judge_dir):
    plain = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    proc = train(tmp_path, judge_dir, reward=plain, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("plait: config error")]
    assert "reward.custom_reward_function.name='compute_score': takes no reward_router_address or " \
           "reward_model_tokenizer" in line
    cmd = [sys.executable, "-m", "plait.cli", "config", "show", "reward.reward_model.enable=true",
           f"reward.reward_model.model_path={judge_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("plait: config error")]
    assert "a Qwen2ForCausalLM checkpoint without a reward function to ask it" in line and "GenRM" in line


@pytest.mark.vllm
def test_a_vllm_judge_scores_through_reward_router_address(tmp_path, vllm_model_path):
    """The judge on vLLM (reward.reward_model.rollout.name=vllm, its engine core a process of its own), the policy
    on plait's engine: the same two request styles, answered by vLLM's continuous batching."""
    pytest.importorskip("vllm")
    train(tmp_path, vllm_model_path, "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.dtype=float32",
          "reward.reward_model.rollout.max_num_batched_tokens=1024", "reward.reward_model.rollout.max_model_len=512")
    for r in [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "timing_s/step" in r]:
        assert r["reward_extra/host_port/mean"] == 1.0 and r["reward_extra/verdict_decodes/mean"] == 1.0
        assert 4 < r["reward_extra/verdict_tokens/mean"] <= 5 and r["judge/requests"] == 32 and r["timing_s/judge"] > 0


# A reward that asks the judge once per response; with a dead judge it raises ("raise" in the mode file) or, as a
# forgiving function would, scores 0 ("default"): either way the judge's death is found and the judge restarted.
ASKING_REWARD = r'''
import json
import urllib.request
from pathlib import Path

MODE = Path(__file__).with_name("mode")


def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
    ids = reward_model_tokenizer.encode("judge: " + solution_str)
    request = urllib.request.Request(f"http://{reward_router_address}/generate", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            json.load(resp)
    except OSError:
        if MODE.read_text() == "raise":
            raise
        return {"score": 0.0, "answered": 0.0}
    return {"score": float(solution_str.strip().startswith(str(ground_truth))), "answered": 1.0}
'''


def asking_config(tmp_path: Path, judge: str, *extra: str):
    from plait.config import load_config
    (tmp_path / "judge_reward.py").write_text(ASKING_REWARD)
    (tmp_path / "mode").write_text("raise")
    return load_config(None, [*TINY, "trainer.logger=[]", "reward.num_workers=1", f"reward.reward_model.model_path={judge}",
                              f"reward.custom_reward_function.path={tmp_path / 'judge_reward.py'}",
                              f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=3", *extra])


@pytest.mark.ray
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_judges_ray_worker_killed_is_restarted_once_a_step_and_the_run_completes(tmp_path, judge_dir, capfd, replicas):
    """The judge on a pool of its own (verl's standalone mode): its rank-0 worker process is killed as step 2's
    reward call begins (the reward function raises on the refused request) and again in step 3 (it scores 0
    instead). Each time the judge's pool comes back on new processes and addresses (two replicas: a new
    torch.distributed world of their own), the reward call is re-issued there, and every response of every step
    is judged; the restart is counted and said once a step."""
    pytest.importorskip("ray")
    from plait import driver
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    lifecycle = driver.build(asking_config(tmp_path, judge_dir, *RAY, *STANDALONE,
                                           f"reward.reward_model.n_gpus_per_node={replicas}"), progress=False)
    trainer, killed, addresses = lifecycle.trainer, [], []
    judge, reward = trainer.roles.judge, trainer.reward_fn

    def killing(request):
        if trainer.step in (2, 3) and len(killed) < trainer.step - 1:
            (tmp_path / "mode").write_text("raise" if trainer.step == 2 else "default")
            addresses.append(request.routers)
            killed.append(judge.pids[0])
            os.kill(killed[-1], signal.SIGKILL)
        return reward(request)
    trainer.reward_fn = killing
    lifecycle.run()
    assert len(killed) == 2 and judge.pids[0] not in killed
    assert len(trainer.routers) == replicas and not set(trainer.routers) & set(addresses[0] + addresses[1])
    assert not set(addresses[0]) & set(addresses[1])  # new replicas, new ports, each time
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["reward/model_restarts"] for r in records] == [0, 1, 1]
    assert all(r["reward_extra/answered/mean"] == 1.0 for r in records)  # the re-issued calls were judged
    assert all(r["judge/requests"] == 16 for r in records)
    err = capfd.readouterr().err
    for step in (2, 3):
        assert err.count(f"plait: warning: the judge died in step {step} (its Ray worker process died during ") == 1
    assert "Traceback" not in err


def test_a_judge_dead_twice_in_one_step_ends_the_run_in_one_line(tmp_path, judge_dir, monkeypatch):
    """A second death in the step of a restart is the run's error (the restart once a step is for a process that
    died, not one that cannot stay up), planted here on the local backend."""
    from plait import driver
    from plait.errors import EngineDied, EngineFailed
    from plait.workers.judge import Judge
    lifecycle = driver.build(asking_config(tmp_path, judge_dir, "reward.num_workers=0"), progress=False)
    trainer, deaths = lifecycle.trainer, []

    def up(judge):
        if trainer.step == 2:
            deaths.append(trainer.step)
            raise EngineDied("its Ray worker process died during Judge.up")
    monkeypatch.setattr(Judge, "up", up)
    with pytest.raises(EngineFailed) as failed:
        lifecycle.run()
    assert deaths == [2, 2] and "\n" not in str(failed.value)
    assert str(failed.value) == ("the judge failed again in step 2, after a restart in the same step: its Ray worker "
                                 "process died during Judge.up")
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1] and records[0]["reward/model_restarts"] == 0


@pytest.mark.ray
def test_a_classifier_reward_models_ray_worker_killed_is_restarted_too(tmp_path, capfd):
    """The reward pool's other tenant, a classifier reward model: killed as step 2 learns, restarted once, the
    scoring call re-issued, the run complete."""
    pytest.importorskip("ray")
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    from plait import driver
    from plait.backends import LEAN_RAY_ENV
    from plait.config import load_config
    from plait.models import build_char_tokenizer
    os.environ.update(LEAN_RAY_ENV)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    cfg = load_config(None, [*TINY, *RAY, *STANDALONE, "trainer.logger=[]", f"reward.reward_model.model_path={tmp_path / 'rm'}",
                             f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=3"])
    lifecycle = driver.build(cfg, progress=False)
    trainer, killed = lifecycle.trainer, []
    reward_model, learn = trainer.roles.reward_model, trainer.learn

    def learning(batch, timer, *rest):
        if trainer.step == 2 and not killed:
            killed.append(reward_model.pids[0])
            os.kill(killed[-1], signal.SIGKILL)
        return learn(batch, timer, *rest)
    trainer.learn = learning
    lifecycle.run()
    assert killed and reward_model.pids[0] != killed[0]
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [(r["step"], r["reward/model_restarts"]) for r in records] == [(1, 0), (2, 1), (3, 0)]
    assert capfd.readouterr().err.count("plait: warning: the reward model died in step 2 (its Ray worker process died") == 1
