"""The smollm2_gsm8k_tools preset: its rows, tool file and warm start settings load without the model; with
the model's package (marker `realmodel`, deselected by default:
`python -m pytest -m realmodel tests/trainers/test_smollm2_tools_preset.py`) the transcript warm start and a
few GRPO steps of the real model calling the calculator run end to end and report the tool-call rates."""

import json
import os

import pyarrow.parquet as pq
import pytest

import plait.cli
from plait.cli import main
from plait.config import load_config, shipped_tool_config
from plait.configtree import ConfigError
from plait.data.tasks import make_task_rows


def test_preset_serves_the_tool_less_problems_with_a_calculator():
    cfg = load_config(plait.cli.builtin_config("smollm2_gsm8k_tools"))
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.tool_config_path.endswith(os.path.join("plait", "configs", "tools", "calculator.yaml"))
    assert os.path.isfile(mt.tool_config_path) and mt.format == "hermes" and cfg.warmstart.steps > 0
    plain, tools = (make_task_rows(t, "test", 8, 0) for t in ("gsm8k_synthetic", "gsm8k_synthetic_tools"))
    assert [r["prompt"] for r in plain] == [r["prompt"][1:] for r in tools]  # the same problems, same order
    assert all(r["prompt"][0]["role"] == "system" and "calculator" in r["prompt"][0]["content"]
               and r["agent_name"] == "tool_agent" and r["data_source"] == "gsm8k_synthetic" for r in tools)


def test_a_shipped_tool_file_by_name_and_a_path_wins(tmp_path, monkeypatch):
    assert shipped_tool_config("calculator").endswith("calculator.yaml")
    assert shipped_tool_config("no_such_tool") == "no_such_tool" and shipped_tool_config(None) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calculator").write_text("tools: []\n")
    assert shipped_tool_config("calculator") == "calculator"  # the user's file


def test_warmstart_on_a_task_without_transcripts_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(plait.cli.builtin_config("smollm2_gsm8k"), ["warmstart.steps=3"])
    assert "warmstart.steps" in str(err.value) and "gsm8k_synthetic_tools" in str(err.value)


SMOKE = ["data.train_size=16", "data.val_size=4", "data.val_batch_size=4", "data.train_batch_size=2",
         "data.max_response_length=64", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "warmstart.steps=2", "warmstart.batch_size=2",
         "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.num_threads=1", "trainer.logger=[]"]
RATES = ("agent_loop/tool_call_rate", "agent_loop/valid_call_rate")


@pytest.mark.realmodel
def test_tools_preset_warm_starts_and_runs_a_few_steps_reporting_the_rates(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", "smollm2_gsm8k_tools", "--no-progress", f"trainer.default_local_dir={out}", *SMOKE]) == 0
    marker = json.loads((out / "warmstart" / "warmstart.json").read_text())
    assert marker["settings"]["steps"] == 2 and len(marker["losses"]) == 2 and all(x > 0 for x in marker["losses"])
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    val = [r for r in records if "val-core/gsm8k_synthetic/acc/mean@1" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert all(0 <= r["val-core/gsm8k_synthetic/acc/mean@1"] <= 1 and all(0 <= r[f"val-aux/{k}"] <= 1 for k in RATES)
               for r in val)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 <= r[k] <= 1 for r in steps for k in RATES) and all(r["num_turns/mean"] >= 2 for r in steps)
    rows = pq.read_table(out / "data" / "gsm8k_synthetic_tools_test.parquet").to_pylist()
    assert {r["agent_name"] for r in rows} == {"tool_agent"}
