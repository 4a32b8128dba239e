"""verl's newest scripts (verl 0.9.1's main): another training engine is named before any other key, machinery
loads with one line (fsdp_turbo, model_engine=dp, the agent-loop worker pool), and the V1 trainer's keys read."""

import pytest

from plait.cli import main
from plait.config import load_config


def config_errors(capsys, *overrides) -> tuple[int, list[str], str]:
    code = main(["config", "show", *overrides])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("plait: config error")], err


@pytest.mark.parametrize("engine_key, name", [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "Megatron-LM"),
    ("model_engine=megatron", "Megatron-LM"),
    ("model_engine=veomni", "VeOmni"),
    ("actor_rollout_ref.actor.veomni.param_offload=true", "VeOmni"),
    ("model_engine=torchtitan", "TorchTitan"),
    ("actor@actor_rollout_ref.actor=mlite_actor", "Megatron Lite"),
])
def test_another_training_engine_is_the_one_line_whatever_comes_first(capsys, engine_key, name):
    # a semantic key the engine's script sets before its engine keys (verl's Megatron scripts set an optimizer offload)
    code, errors, _ = config_errors(capsys, "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1.0",
                                    engine_key)
    assert code == 2 and len(errors) == 1 and f"{name} is not supported" in errors[0], errors


def test_machinery_of_the_newest_scripts_loads_with_notices(capsys):
    code, errors, err = config_errors(capsys, "model_engine=dp", "actor_rollout_ref.actor.strategy=fsdp_turbo",
                                      "actor_rollout_ref.ref.strategy=fsdp_turbo", "actor_rollout_ref.rollout.agent.num_workers=2",
                                      "transfer_queue.enable=true", "+actor_rollout_ref.actor.fsdp_config.turbo_config.x=1")
    assert code == 0 and errors == []
    assert "strategy=fsdp_turbo: verl's FSDP-Turbo engine is FSDP2" in err
    cfg = load_config(None, ["actor_rollout_ref.actor.strategy=fsdp_turbo", "actor_rollout_ref.ref.strategy=fsdp_turbo"])
    assert cfg.actor_rollout_ref.actor.strategy == cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    for key in ("model_engine", "actor_rollout_ref.rollout.agent.num_workers", "transfer_queue.enable"):
        assert f"      {key}\n" in err


def test_data_gen_batch_size_is_read_by_the_v1_modes_and_named_elsewhere(capsys):
    code, _, err = config_errors(capsys, "data.gen_batch_size=4")
    assert code == 0 and "      data.gen_batch_size\n" in err
    code, _, err = config_errors(capsys, "data.gen_batch_size=4", "trainer.v1.trainer_mode=colocate_async")
    assert code == 0 and "      data.gen_batch_size\n" not in err
