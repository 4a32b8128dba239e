"""verl's interface: its override syntax, its defaults, and its own example scripts.

tests/fixtures/verl_scripts/ holds the arguments of verl's example scripts and recipes (facts
about verl's interface), with model/data paths, sizes and the engine name changed for a tiny CPU
run. Each one must load; the Megatron one is refused with one line, the Ascend (NPU) ones load with one
notice line each; a few train 2 steps.
"""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli import main
from plait.config import load_config, parse_value
from plait.configtree import ConfigError, ConfigErrors

SCRIPTS = Path(__file__).parent / "fixtures" / "verl_scripts"
REFUSED = {"ppo_megatron_nsys": "Megatron-LM is not supported"}
# verl 0.9 failure classes that `plait train` refuses at start, in one config-error line naming what to fix
REFUSED_AT_START = {"sppo": "SPPO", "prime": "PRIME recipe", "loggers_swanlab_mlflow": "pip install",
                    "filter_overlong_all_rows": "shortest prompt has", "minicpmo_custom_dataset": "data.custom_cls.path"}


def script_args(name: str, paths: dict[str, str]) -> list[str]:
    """The command line of a recorded verl script after `plait train`, with $VARS filled in."""
    text = "\n".join(line for line in (SCRIPTS / f"{name}.sh").read_text().splitlines() if not line.startswith("#"))
    argv = shlex.split(re.sub(r"\$(\w+)", lambda m: paths[m.group(1)], text.replace("\\\n", " ")))
    assert argv[:2] == ["plait", "train"]
    return argv[2:]


def script_overrides(name: str, paths: dict[str, str]) -> list[str]:
    """The overrides of a recorded script, the mode its --entry-point implies first."""
    from plait.config_verl import entry_point_overrides
    args = script_args(name, paths)
    if args[:1] == ["--entry-point"]:
        return [*entry_point_overrides(args[1]), *args[2:]]
    return args


def tiny_classifier(path) -> str:
    """A reward model: a tiny Qwen2 sequence classifier (score head saved) over the char tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from plait.models import TINY_SIZES, build_char_tokenizer
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id, **TINY_SIZES["xs"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from plait.data.tasks import write_task_files
    from plait.models import create_tiny_model
    root = tmp_path_factory.mktemp("verl")
    model = create_tiny_model(root / "model", size="xs")
    train, test = write_task_files("arithmetic", root / "data", 16, 4)
    return {"MODEL_PATH": model, "REWARD_MODEL_PATH": tiny_classifier(root / "rm"), "TRAIN_FILE": train, "TEST_FILE": test,
            "OUT": str(root / "out")}


def test_there_are_twenty_seven_recorded_scripts():
    assert len(list(SCRIPTS.glob("*.sh"))) == 27


@pytest.mark.parametrize("name", sorted(p.stem for p in SCRIPTS.glob("*.sh")
                                        if p.stem not in REFUSED and p.stem not in ("sppo", "prime", "minicpmo_custom_dataset")))
def test_every_recorded_verl_script_loads(name, tiny_paths, capsys):
    cfg = load_config(None, script_overrides(name, tiny_paths))
    assert cfg.actor_rollout_ref.model.path == tiny_paths["MODEL_PATH"]
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    # The engine-tuning keys a script sets are named once (in one block), never refused.
    assert capsys.readouterr().err.count("accepted but have no effect here") <= 1


@pytest.mark.parametrize("name, said", [
    ("npu_discrete_profiling", "plait: global_profiler.tool=npu: Ascend's profiler does not run here, so no profile is taken"),
    ("dapo_qwen2_5_7b_npu", "plait: trainer.device=npu: Ascend NPUs are not supported; plait runs on what this machine has"),
    ("gmpo_qwen2_5_7b_math", "plait: actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']: plait's checkpoints "
                             "always hold the model, optimizer and extra"),
])
def test_a_scripts_machine_choices_load_with_one_notice_line(name, said, tiny_paths, capsys):
    """verl's Ascend scripts train the same model with the same algorithm: the device is machinery, so
    they run on what this machine has; a checkpoint verl would write without its optimizer is whole."""
    cfg = load_config(None, script_overrides(name, tiny_paths))
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith(said)] != []
    assert cfg.trainer.device == "auto" and cfg.global_profiler.tool != "npu"
    assert {"model", "optimizer", "extra"} <= set(cfg.actor_rollout_ref.actor.checkpoint.save_contents)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_megatron_scripts_are_refused_with_one_line(name, tiny_paths, capsys):
    assert main(["train", *script_args(name, tiny_paths)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and REFUSED[name] in err


@pytest.mark.parametrize("name", sorted(REFUSED_AT_START))
def test_verl_0_9_failure_classes_refuse_at_start_in_one_line(name, tiny_paths, capsys):
    import importlib.util
    if name == "loggers_swanlab_mlflow" and importlib.util.find_spec("swanlab") and importlib.util.find_spec("mlflow"):
        pytest.skip("swanlab and mlflow are installed here")
    assert main(["train", "--no-progress", *script_args(name, tiny_paths)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("plait: config error")]
    assert len(errors) == 1 and REFUSED_AT_START[name] in errors[0] and "Traceback" not in err, err


DAPO_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
               "    return {'score': float(len(solution_str) % 3), 'acc': float(len(solution_str) % 2)}\n")


@pytest.mark.parametrize("name", ["grpo_qwen2_7b", "ppo_deepseek7b", "one_step_off_grpo", "ppo_reward_model",
                                  "grpo_lora_qwen2_5_3b", "dapo_qwen2_5_7b", "main_ppo_verl091_cispo",
                                  "fully_async_train_batch_0", "otb_qwen2_5_7b", "ppo_pfppo_deepseek7b",
                                  "v1_separate_async_e2e", "v1_colocate_async_disrm"])
def test_recorded_scripts_train_two_steps(name, tiny_paths, tmp_path):
    # What a user without wandb appends, as verl's scripts pass on "$@".
    extra = ["trainer.total_training_steps=2", "trainer.logger=console", f"trainer.default_local_dir={tmp_path}"]
    if name == "dapo_qwen2_5_7b":  # DAPO's filter needs an "acc" that varies within groups; the tiny model scores 0
        (tmp_path / "reward.py").write_text(DAPO_REWARD)
        extra += [f"reward.custom_reward_function.path={tmp_path / 'reward.py'}"]
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--no-progress",
                           *script_args(name, tiny_paths), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 2


def test_three_unknown_keys_are_reported_in_one_run():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "train", "trainer.total_traning_steps=3",
                           "actor_rollout_ref.actor.optim.lrr=1e-6", "data.max_prompt_lenght=64", "data.shuffle=False"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3
    for key, close in [("trainer.total_traning_steps", "trainer.total_training_steps"),
                       ("actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr"),
                       ("data.max_prompt_lenght", "data.max_prompt_length")]:
        assert any(key in line and f"did you mean '{close}'" in line for line in lines), (key, lines)


def test_unknown_keys_and_bad_values_are_collected_together():
    with pytest.raises(ConfigErrors) as info:
        load_config(None, ["trainer.nope=1", "actor_rollout_ref.rollout.n=many", "critic.optim.lr=x"])
    assert {e.key for e in info.value.errors} == {"critic.optim.lr", "actor_rollout_ref.rollout.n", "trainer.nope"}


@pytest.mark.parametrize("raw, value", [
    ("['a','b']", ["a", "b"]), ("[a,b]", ["a", "b"]), ('["console","wandb"]', ["console", "wandb"]),
    ("null", None), ("None", None), ("~", None), ("3e-4", 3e-4), ("True", True), ("false", False),
    ("/p/train.parquet", "/p/train.parquet"), ("", ""),
])
def test_values_parse_as_hydra_reads_them(raw, value):
    assert parse_value(raw) == value


def test_override_prefixes_and_bare_strings_for_lists():
    cfg = load_config(None, ["+trainer.logger=console", "data.train_files=/p/train.parquet", "trainer.test_freq=3",
                             "~trainer.test_freq", "++actor_rollout_ref.actor.ppo_epochs=2",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4"])
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.train_files == ["/p/train.parquet"]
    assert cfg.trainer.test_freq == 10  # ~key dropped the override: the demo preset's value
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 2 and cfg.critic.ppo_epochs == 2  # the critic inherits
    assert cfg.reward.reward_kwargs == {"overlong_buffer_cfg": {"len": 4}}  # verl 0.8 spelling, mapped


def test_defaults_are_verls_once_a_model_path_is_given(tmp_path):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path}"])
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    assert (arr.rollout.n, cfg.algorithm.adv_estimator, arr.actor.optim.lr) == (1, "gae", 1e-6)
    assert (t.save_freq, t.test_freq, t.total_training_steps, t.total_epochs) == (-1, -1, None, 30)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 512, 512)
    assert (arr.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size, cfg.critic.optim.lr) == (256, 256, 1e-5)
    assert (arr.actor.optim.lr_warmup_steps, arr.actor.optim.lr_scheduler_type, arr.model.lora_rank) == (-1, "constant", 0)
    assert arr.rollout.val_kwargs.temperature == 0 and cfg.critic.enable
    demo = load_config(None, [])  # no model path: the demo preset
    assert (demo.actor_rollout_ref.rollout.n, demo.algorithm.adv_estimator, demo.trainer.total_training_steps) == (8, "grpo", 150)


def test_no_effect_keys_are_named_once_grouped_by_reason(capsys):
    load_config(None, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "trainer.n_gpus_per_node=8"])
    err = capsys.readouterr().err
    block = err[err.index("accepted but have no effect"):]
    assert block.count("this run's rollout engine is hf") == 1 and block.count("FSDP") == 1 and "local backend" in block
    for key in ("gpu_memory_utilization", "tensor_model_parallel_size", "fsdp_config.fsdp_size", "n_gpus_per_node"):
        assert f"actor_rollout_ref.rollout.{key}" in block or key in block


@pytest.mark.parametrize("override, key, words", [
    pytest.param("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name", "vllm is not installed here",
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name", "use rollout.name=vllm"),
    ("actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.name", "one of hf, vllm, sglang"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy", "Megatron-LM is not supported"),
    ("async_training.staleness_threshold=0.5", "trainer.mode", "async_training.staleness_threshold"),
])
def test_verl_choices_plait_cannot_run_are_clear_errors(override, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key and words in str(info.value)


def test_accepted_engine_and_strategy_names():
    cfg = load_config(None, ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.actor.strategy=fsdp2",
                             "trainer.mode=fully_async", "trainer.placement=separated", "async_training.require_batches=2"])
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" and cfg.async_training.require_batches == 2


def test_config_show_checks_what_train_checks():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "config", "show", "data.train_files=/no/such.parquet",
                           "actor_rollout_ref.model.path=/no/such/model"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.train_files" in proc.stderr and "actor_rollout_ref.model.path" in proc.stderr


def test_no_key_is_both_a_field_and_in_the_no_effect_table():
    from plait.config import PlaitConfig, _leaf_items
    from plait.config_verl import NO_EFFECT
    from plait.configtree import to_dict
    fields = {key for key, _ in _leaf_items(to_dict(PlaitConfig()), "")}
    sections = {key.rsplit(".", i)[0] for key in fields for i in range(1, key.count(".") + 1)}
    assert not set(NO_EFFECT) & (fields | sections)
