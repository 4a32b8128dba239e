"""LoRA on the tiny demo model, end to end: adapters train, the base stays, the reference is the
base with adapters off, the rollout gets the merged weights, and checkpoints round-trip the adapter."""

import os

import torch

from plait import driver
from plait.models import load_causal_lm
from plait.build import resolve_model
from plait.data.dataset import prompt_batch
from plait.workers.actor import Actor, response_forward
from plait.workers.packing import MicroBatching
from plait.workers.rollout import Rollout

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.val_before_train=false"]


def test_lora_trains_adapters_only_with_the_base_as_reference(tmp_path, tiny_config):
    # a reward that varies within every group from step 1 (the untrained model's answers are all wrong)
    (tmp_path / "reward.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return len(solution_str) / 10\n")
    cfg = tiny_config(tmp_path, *LORA, f"custom_reward_function.path={tmp_path / 'reward.py'}",
                      "custom_reward_function.name=length")
    lifecycle = driver.build(cfg, progress=False)
    trainer = lifecycle.trainer
    assert trainer.roles.ref is None  # no second model copy
    actor: Actor = trainer.roles.actor.worker
    model_path = resolve_model(cfg)
    base = load_causal_lm(model_path).eval()
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    lora_before = {n: p.detach().clone() for n, p in actor.model.named_parameters() if n in trainable}

    lifecycle.run()

    lora_after = dict(actor.model.named_parameters())
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in trainable)
    merged = actor.state_dict()
    base_state = base.state_dict()
    assert set(merged) == set(base_state)
    for name, value in actor.model.get_base_model().state_dict().items():  # the base weights did not move
        if "lora_" not in name:
            assert torch.equal(value, base_state[name.replace(".base_layer", "")]), name
    assert any(not torch.equal(merged[k], base_state[k]) for k in merged)  # the adapter changes the policy
    rollout_state = trainer.roles.rollout.worker.engine.model.state_dict()
    assert all(torch.allclose(rollout_state[k], merged[k]) for k in merged)  # the rollout got the merge

    items = [trainer.cursor.dataset[i] for i in range(2)]
    batch = trainer.roles.rollout.call(Rollout.generate, prompt_batch(items), trainer.sampling, 0)
    ref = actor.compute_ref_log_prob(batch, 8)
    expected, _ = response_forward(base, batch, 1.0, MicroBatching(8), with_entropy=False)
    torch.testing.assert_close(ref, expected)                             # ref == base
    policy, _ = actor.compute_log_prob(batch, 8)
    assert not torch.allclose(policy, ref)                                # and the policy is not

    ckpt = tmp_path / "checkpoints" / "global_step_2" / "actor"
    assert os.path.isfile(ckpt / "lora_adapter" / "adapter_model.safetensors")
    assert not os.path.exists(ckpt / "model.pt")  # the adapter alone, not the base weights
    fresh = Actor(model_path, cfg.actor_rollout_ref.actor, 4, 1.0, actor.profiler, seed=99,
                  model_cfg=cfg.actor_rollout_ref.model)
    fresh.load_checkpoint(str(ckpt))
    fresh_params = dict(fresh.model.named_parameters())
    assert all(torch.equal(fresh_params[n], lora_after[n]) for n in trainable)
