"""verl's GSM8K multi-turn example (examples/sglang_multiturn: gsm8k_multiturn_grpo.yaml, its tool
config and its command line) on this CPU: the demo's tiny model and generated GSM8K-style rows in
verl's gsm8k_tool_agent_loop format swapped in, sizes shrunk, rollout.name=hf (and vllm, run with the
vLLM environment's python), in every LM mode, on the local and the Ray backend. The run must train
through the tool agent loop, report verl's agent metrics and name no multi_turn key as having no
effect. The tiny random model does not write tool calls; tests/agents/test_loop.py covers the calls."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from plait.data.tasks import make_task_rows
from plait.trainers.lifecycle import read_metrics

REPO = Path(__file__).resolve().parents[2]

VERL_YAML = (Path(__file__).resolve().parents[1] / "fixtures" / "verl_configs" / "gsm8k_multiturn_grpo.yaml").read_text()

TOOL_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""

SYSTEM = ("You are a math expert. Use the `calc_gsm8k_reward` tool after solving the question. "
          "Put your final answer in the format of `#### <answer>`.")


def write_rows(path: Path, split: str, n: int) -> None:
    """Rows as verl's examples/data_preprocess/gsm8k_tool_agent_loop.py writes them."""
    rows = []
    for r in make_task_rows("arithmetic", split, n, seed=0):
        answer = r["reward_model"]["ground_truth"]
        rows.append({"data_source": "openai/gsm8k", "agent_name": "tool_agent",
                     "prompt": [{"role": "system", "content": SYSTEM}, *r["prompt"]], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": split, "index": r["extra_info"]["index"], "need_tools_kwargs": True,
                                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}}}})
    pq.write_table(pa.Table.from_pylist(rows), path)


def verl_command(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "config").mkdir(exist_ok=True)
    (tmp_path / "config" / "gsm8k_multiturn_grpo.yaml").write_text(VERL_YAML)
    (tmp_path / "gsm8k_tool_config.yaml").write_text(TOOL_YAML)
    write_rows(tmp_path / "train.parquet", "train", 16)
    write_rows(tmp_path / "test.parquet", "test", 4)
    return [sys.executable, "-m", "plait.cli", "train", f"--config-path={tmp_path / 'config'}",
            "--config-name=gsm8k_multiturn_grpo", "--no-progress",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=256",
            "data.max_response_length=24", "data.filter_overlong_prompts=True", "data.truncation=error",
            "data.return_raw_chat=True", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.mode=async", "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
            "trainer.logger=[console]", "trainer.save_freq=-1", "trainer.test_freq=2", "trainer.val_before_train=True",
            f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'gsm8k_tool_config.yaml'}",
            "trainer.total_training_steps=2", "demo.model_size=xs", "demo.warmstart_steps=0",
            f"trainer.default_local_dir={tmp_path / 'run'}", *extra]


RAY = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5"]


# one_step_off on Ray runs in tests/trainers/test_async_modes_ray.py (without tools: its Ray path is the same)
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async", "sync_ray", "fully_async_ray"])
def test_verls_gsm8k_multiturn_command_line_runs(tmp_path, mode):
    extra = {"sync": [], "one_step_off": ["trainer.mode=one_step_off", "trainer.placement=separated"],
             "sync_ray": RAY,
             "fully_async_ray": [*RAY, "trainer.mode=fully_async", "trainer.placement=separated",
                                 "async_training.partial_rollout=True", "async_training.trigger_parameter_sync_step=1",
                                 "async_training.staleness_threshold=1"],
             "fully_async": ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.partial_rollout=True",
                             "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1"]}[mode]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(verl_command(tmp_path, *extra), capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "multi_turn" not in proc.stderr and "rollout.agent" not in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    train = [r for r in records if "num_turns/mean" in r]
    assert len(train) == 2
    for key in ("num_turns/min", "num_turns/max", "agent_loop/generate_sequences/mean", "agent_loop/tool_calls/max",
                "agent_loop/slowest/generate_sequences", "agent_loop/slowest/response_length"):
        assert key in train[-1], key
    assert train[-1]["num_turns/min"] >= 2


VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.max_model_len=512", "actor_rollout_ref.rollout.enable_prefix_caching=True"]


FULLY_ASYNC = ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.partial_rollout=True",
               "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1"]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "fully_async_ray"])
def test_verls_gsm8k_multiturn_command_line_on_vllm(tmp_path, mode, vllm_model_path):
    """The same command line with rollout.name=vllm (run with the vLLM environment's python); one_step_off and
    local fully_async with vLLM run in tests/trainers/test_vllm_modes.py."""
    pytest.importorskip("vllm")
    extra = {"sync": [], "fully_async_ray": [*RAY, *FULLY_ASYNC]}[mode]
    cmd = [c.replace("actor_rollout_ref.rollout.name=hf", VLLM[0]) for c in verl_command(tmp_path, *VLLM[1:], *extra)]
    cmd.append(f"actor_rollout_ref.model.path={vllm_model_path}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "multi_turn" not in proc.stderr and "rollout.agent" not in proc.stderr, proc.stderr[-3000:]
    train = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "num_turns/mean" in r]
    assert len(train) == 2 and train[-1]["agent_loop/generate_sequences/mean"] > 0
