"""The failure classes of verl scripts that plait refused or ran wrongly: each now runs, or refuses in
one line naming the key, the recipe or the fix (verl 0.9.1's behaviour where it has one)."""

import subprocess
import sys
import textwrap

import pytest

from plait.cli import main
from plait.config import load_config
from plait.config_verl import EMPTY_IS_NULL
from plait.configtree import ConfigError, to_dict


def one_line_exit_2(argv, capsys, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("plait: config error")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    for word in words:
        assert word in errors[0], (word, errors[0])


@pytest.mark.parametrize("overrides, check", [
    # CISPO's documented setting: no floor on the ratio
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.clip_ratio_low=10"],
     lambda c: c.actor_rollout_ref.actor.clip_ratio_low == 10),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.clip_ratio_low=10"],
     lambda c: c.actor_rollout_ref.actor.clip_ratio_low == 10),
    (["algorithm.rollout_correction.rollout_is=null", "algorithm.rollout_correction.rollout_is_threshold=null"],
     lambda c: c.algorithm.rollout_correction.rollout_is_threshold is None),
    (["custom_reward_function.path=null", "custom_reward_function.name=null"],
     lambda c: c.reward.custom_reward_function.name == "compute_score"),
    # verl 0.9.1: auto with a path resumes from that path
    (["trainer.resume_mode=auto", "trainer.resume_from_path=/ckpt/global_step_5"],
     lambda c: c.trainer.resume_mode == "resume_path" and c.trainer.resume_from_path == "/ckpt/global_step_5"),
    (["trainer.logger=[console,swanlab,mlflow,json_eval,file]"], lambda c: "json_eval" in c.trainer.logger),
    # fully-async scripts: the trainer's batch is ppo_mini_batch_size x require_batches
    (["trainer.mode=fully_async", "trainer.placement=separated", "data.train_batch_size=0",
      "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.require_batches=3"],
     lambda c: c.data.train_batch_size == 12),
    (["actor_rollout_ref.model.torch_dtype=bfloat16", "trainer.log_freq=10", "trainer.debug=false",
      "trainer.tensorboard_dir=/tb", "actor_rollout_ref.actor.num_images_in_input=2",
      "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4",
      "algorithm.rollout_correction.rollout_rs_threshold_lower=0.5",
      "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"], lambda c: True),
])
def test_values_and_keys_verl_accepts_load(overrides, check, capsys):
    assert check(load_config(None, overrides))


@pytest.mark.parametrize("overrides, words", [
    (["actor_rollout_ref.actor.clip_ratio_low=10"], "cispo or clip_cov"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=null"],
     "a number or a 'lower_upper' string with rollout_is=token"),
    (["data.train_batch_size=0"], "0 only with trainer.mode=fully_async"),
    (["trainer.logger=[console,clearml]"], "one of console, tensorboard, wandb, mlflow, swanlab"),
    (["data.filter_accuracy=true"], "PRIME recipe"),
    (["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"],
     "not with bypass mode"),
])
def test_values_plait_cannot_run_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(None, overrides)


@pytest.mark.parametrize("logger", ["mlflow", "swanlab", "wandb"])
def test_config_show_and_train_agree_on_a_missing_logger_package(logger, capsys, tmp_path):
    pytest.importorskip("sys")
    import importlib.util
    if importlib.util.find_spec(logger):
        pytest.skip(f"{logger} is installed here")
    for command in (["config", "show"], ["train", "--no-progress", f"trainer.default_local_dir={tmp_path}"]):
        one_line_exit_2([*command, f"trainer.logger=[console,{logger}]"], capsys, f"pip install {logger}")


def test_a_reward_file_that_imports_a_missing_module_is_one_line(tmp_path, capsys):
    for module, missing, fix in (("verl.utils.reward_score", "verl", "pip install --no-deps verl==0.9.1"),
                                 ("datasets_not_here", "datasets_not_here", "pip install datasets_not_here")):
        (tmp_path / "reward.py").write_text(f"import {module}\ndef compute_score(**kw):\n    return 0.0\n")
        one_line_exit_2(["config", "show", f"custom_reward_function.path={tmp_path / 'reward.py'}"], capsys,
                        "reward.custom_reward_function.path", f"no module named '{missing}'", fix)
    (tmp_path / "reward.py").write_text("raise RuntimeError('boom at import')\n")
    one_line_exit_2(["config", "show", f"reward.custom_reward_function.path={tmp_path / 'reward.py'}"], capsys,
                    "RuntimeError: boom at import")


def test_a_prompt_filter_that_drops_every_row_is_one_line(tmp_path, capsys):
    argv = ["train", "--no-progress", f"trainer.default_local_dir={tmp_path}", "demo.model_size=xs",
            "demo.warmstart_steps=0", "data.train_size=16", "data.val_size=4", "data.max_prompt_length=2",
            "data.filter_overlong_prompts=true"]
    one_line_exit_2(argv, capsys, "data.filter_overlong_prompts", "shortest prompt has", "max_prompt_length=2")


def test_a_batch_larger_than_the_data_is_one_line(tmp_path, capsys):
    argv = ["train", "--no-progress", f"trainer.default_local_dir={tmp_path}", "demo.model_size=xs",
            "demo.warmstart_steps=0", "data.train_size=4", "data.val_size=4", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"]
    one_line_exit_2(argv, capsys, "data.train_batch_size=8", "larger than the training set (4 prompts in")


@pytest.mark.parametrize("module, words", [
    ("recipe.sppo.main_sppo", "SPPO"), ("recipe.flowrl.main_flowrl", "FlowRL"),
    ("verl.trainer.main_ppo_split", "split placement"), ("verl.experimental.transfer_queue.main_ppo", "transfer-queue"),
    ("recipe.nope.main", "not an entry point plait knows"),
])
def test_recipe_entry_points_plait_does_not_run_are_refused(module, words, capsys):
    one_line_exit_2(["config", "show", "--entry-point", module], capsys, "--entry-point", words)


def test_entry_points_plait_runs_select_the_mode(capsys):
    assert main(["config", "show", "--entry-point", "verl.experimental.fully_async_policy.fully_async_main"]) == 0
    out = capsys.readouterr().out
    assert "mode: fully_async" in out and "placement: separated" in out


def test_a_verl_yaml_with_defaults_hydra_and_targets_loads(tmp_path, capsys):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "my_data.yaml").write_text("max_prompt_length: 48\n")
    (tmp_path / "config" / "dapo_trainer.yaml").write_text(textwrap.dedent("""\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - actor@actor_rollout_ref.actor: dp_actor
          - my_data@data
          - _self_
        data:
          max_response_length: 24
          gen_batch_size: ${data.train_batch_size}
        actor_rollout_ref:
          actor:
            _target_: verl.workers.config.FSDPActorConfig
            ppo_mini_batch_size: ${oc.select:data.train_batch_size,16}
          rollout:
            name: ???
            response_length: ${data.max_response_length}
        reward:
          reward_manager:
            _target_: verl.workers.config.reward.RewardManagerConfig
            name: dapo
        algorithm:
          filter_groups:
            enable: true
            metric: acc
        trainer:
          experiment_name: dapo-${data.max_response_length}
          default_local_dir: ${oc.env:PLAIT_TEST_NO_SUCH_VAR,/tmp/out}/${trainer.experiment_name}
    """))
    assert main(["config", "show", "--config-path", str(tmp_path / "config"), "--config-name", "dapo_trainer",
                 "data.train_batch_size=8"]) == 0
    out = capsys.readouterr().out
    # interpolations resolve after the command line, as Hydra's: the mini-batch follows train_batch_size=8
    for line in ("max_prompt_length: 48", "max_response_length: 24", "ppo_mini_batch_size: 8",
                 "experiment_name: dapo-24", "default_local_dir: /tmp/out/dapo-24", "name: hf", "metric: acc"):
        assert line in out, line
    cfg = load_config(str(tmp_path / "config" / "dapo_trainer.yaml"), ["data.train_batch_size=64"])
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.reward.reward_manager.name == "dapo" and cfg.algorithm.filter_groups.enable


def test_yaml_defaults_naming_nothing_known_and_megatron_are_one_line(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("defaults:\n  - my_missing_piece\n  - _self_\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "a.yaml")], capsys, "my_missing_piece",
                    "neither one of verl's config groups")
    (tmp_path / "b.yaml").write_text("defaults:\n  - actor@actor_rollout_ref.actor: megatron_actor\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "b.yaml")], capsys, "Megatron-LM")
    one_line_exit_2(["config", "show", "--config-name", "sppo_trainer"], capsys, "no sppo_trainer.yaml")
    assert main(["config", "show", "--config-name", "ppo_trainer"]) == 0


def test_no_traceback_from_the_command_line_for_a_verl_yaml_error(tmp_path):
    (tmp_path / "c.yaml").write_text("trainer:\n  experiment_name: ${no.such.key}\n")
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "config", "show", "--config", str(tmp_path / "c.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no.such.key" in proc.stderr


@pytest.mark.parametrize("entry", ["../outside", "{outside}", "sub/../../outside", "{{'../grp': outside}}"])
def test_yaml_defaults_reaching_outside_the_config_folder_are_refused(tmp_path, capsys, entry):
    """Hydra resolves a defaults entry inside the config search path only: an entry that climbs out
    (`..`) or names an absolute path is refused in one line, and the file outside is not applied."""
    (tmp_path / "outside.yaml").write_text("data:\n  max_prompt_length: 999\n")
    (tmp_path / "grp").mkdir()
    (tmp_path / "grp" / "outside.yaml").write_text("data:\n  max_prompt_length: 999\n")
    (tmp_path / "config" / "sub").mkdir(parents=True)
    entry = entry.format(outside=tmp_path / "outside")
    (tmp_path / "config" / "a.yaml").write_text(f"defaults:\n  - {entry}\n  - _self_\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "config" / "a.yaml")], capsys,
                    "a defaults entry names a config inside the config search path", "reaches outside it")


def test_an_interpolation_loop_is_one_line(tmp_path, capsys):
    (tmp_path / "loop.yaml").write_text("trainer:\n  project_name: ${trainer.experiment_name}\n"
                                        "  experiment_name: x-${trainer.project_name}\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "loop.yaml")], capsys, "an interpolation loop: "
                    "trainer.project_name -> trainer.experiment_name -> trainer.project_name")
    (tmp_path / "self.yaml").write_text("data:\n  train_batch_size: ${data.train_batch_size}\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "self.yaml")], capsys,
                    "an interpolation loop: data.train_batch_size -> data.train_batch_size")


def test_interpolations_are_resolved_once_per_key_and_bounded(tmp_path, capsys):
    """Each level doubles the string: 2**60 characters if expanded, and 2**60 lookups without the
    memo; finishing at all shows neither happens (each key is resolved once, the length is bounded)."""
    levels = "".join(f"  k{i}: ${{trainer.k{i + 1}}}${{trainer.k{i + 1}}}\n" for i in range(60))
    (tmp_path / "bomb.yaml").write_text(f"trainer:\n  experiment_name: ${{trainer.k0}}\n{levels}  k60: ab\n")
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "bomb.yaml")], capsys,
                    "its interpolations expand past 100000 characters")
    many = "-".join("${data.max_prompt_length}" for _ in range(40))  # more than the 20 the old resolver stopped at
    (tmp_path / "many.yaml").write_text(f"trainer:\n  experiment_name: {many}\n")
    cfg = load_config(str(tmp_path / "many.yaml"), [])
    assert cfg.trainer.experiment_name == "-".join(["512"] * 40)


def alias_bomb(levels: int, width: int = 10) -> str:
    """The billion-laughs document: level i is a list of `width` aliases of level i-1."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_one_line_before_anything_is_built(tmp_path, capsys):
    """10**13 values if expanded: the loader sizes the node graph (each of its 14 lists once) and
    refuses before constructing, so finishing at all is the proof."""
    from plait.config_verl import YamlBomb, load_yaml
    (tmp_path / "bomb.yaml").write_text(alias_bomb(12))
    one_line_exit_2(["config", "show", "--config", str(tmp_path / "bomb.yaml")], capsys,
                    "not valid YAML: its aliases expand to more than 100000 values (an alias bomb)")
    with pytest.raises(YamlBomb, match="refers to a node that contains it"):
        load_yaml("a: &x [1, *x]\n")
    assert len(list(_flat(load_yaml(alias_bomb(3))["l3"]))) == 10 ** 4  # a small one still loads whole
    # on the command line too: the value is not expanded, it stays the text it was
    flow = "[&a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 13)) + "]"
    cfg = load_config(None, [f"trainer.experiment_name={flow}"])
    assert cfg.trainer.experiment_name == flow


def _flat(xs):
    for x in xs:
        yield from (_flat(x) if isinstance(x, list) else [x])


@pytest.mark.parametrize("key", EMPTY_IS_NULL)
def test_an_empty_value_where_verl_reads_null_is_null(key, capsys):
    """`key=$VAR` with VAR unset: Hydra gives '', which verl reads as null on these keys (by
    truthiness, or not at all in the mode that leaves them unset): the same run as without it."""
    mode = ["trainer.resume_mode=disable"] if key == "trainer.resume_from_path" else []
    assert to_dict(load_config(None, [*mode, f"{key}="])) == to_dict(load_config(None, mode))
    assert to_dict(load_config(None, [*mode, f"{key}=''"])) == to_dict(load_config(None, mode))
    assert key not in capsys.readouterr().err  # no notice names it: it is unset


def test_the_legacy_reward_path_and_a_resume_path_empty_read_as_null(capsys):
    assert load_config(None, ["custom_reward_function.path="]).reward.custom_reward_function.path is None
    one_line_exit_2(["config", "show", "trainer.resume_mode=resume_path", "trainer.resume_from_path="], capsys,
                    "a global_step_N checkpoint directory when resume_mode=resume_path")


def test_an_empty_boolean_is_false_as_verl_reads_it_and_named(capsys):
    """verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh passes
    use_kl_loss=True, then use_kl_loss=${use_kl_loss} with the variable set nowhere: verl reads the
    last value, '', by truthiness and trains without the KL loss. So does plait, saying so."""
    cfg = load_config(None, ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss=",
                             "data.shuffle=''"])
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False and cfg.data.shuffle is False
    assert ("plait: actor_rollout_ref.actor.use_kl_loss, data.shuffle are empty (as an unset shell variable gives): "
            "read as false, as verl reads them") in capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("override, said", [
    ("actor_rollout_ref.model.path=", "actor_rollout_ref.model.path='': no config.json"),
    ("data.train_files=", "data.train_files=''"),
    ("trainer.total_training_steps=", "trainer.total_training_steps='': expected int or null"),
    ("trainer.experiment_name=", "trainer.experiment_name='': a folder name"),
])
def test_an_empty_value_elsewhere_is_still_checked_as_a_value(override, said, capsys):
    one_line_exit_2(["train", "--no-progress", override], capsys, said)
