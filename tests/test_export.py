"""`plait export` and `checkpoint.save_contents=[..., hf_model]`: a checkpoint's policy as a Hugging Face
folder that transformers loads back with the checkpoint's log-probs and greedy answers; FSDP2 shards
gathered to the same folder as their unsharded twin; LoRA merged or kept as an adapter."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait import driver
from plait.cli import main
from plait.build import resolve_model
from plait.trainers.lm import prompt_batch
from plait.workers.actor import Actor, response_forward
from plait.workers.packing import MicroBatching
from plait.workers.rollout import Rollout

SAVE = ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.val_before_train=false", "trainer.test_freq=-1"]


def trained(tmp_path, tiny_config, *overrides):
    """A 2-step run's lifecycle (its actor holds what global_step_2 saved) and a rollout batch."""
    lifecycle = driver.build(tiny_config(tmp_path, *SAVE, *overrides), progress=False)
    lifecycle.run()
    trainer = lifecycle.trainer
    batch = trainer.roles.rollout.call(Rollout.generate, prompt_batch([trainer.cursor.dataset[i] for i in range(3)]),
                                       trainer.sampling, 0)
    return trainer, batch


def greedy(model, tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0].tolist()


def test_export_loads_in_transformers_with_the_checkpoints_logprobs_and_greedy_answer(tmp_path, tiny_config):
    trainer, batch = trained(tmp_path, tiny_config, "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    actor: Actor = trainer.roles.actor.worker
    step = tmp_path / "checkpoints" / "global_step_2"
    out = tmp_path / "exported"
    assert main(["export", str(step), str(out)]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    got, _ = response_forward(model, batch, 1.0, MicroBatching(8), with_entropy=False)
    want, _ = actor.compute_log_prob(batch, 8)
    torch.testing.assert_close(got, want)
    prompt = "What is 12 + 7?\n"
    assert greedy(model, tokenizer, prompt) == greedy(actor.model.eval(), tokenizer, prompt)
    # the initial model differs: the export holds the trained weights, not the base
    base = AutoModelForCausalLM.from_pretrained(resolve_model(trainer.cfg), local_files_only=True)
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), model.state_dict().values()))
    # save_contents hf_model wrote the same folder into the checkpoint, under its manifest
    inside = step / "actor" / "huggingface"
    assert load_file(inside / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()
    assert all(torch.equal(v, load_file(out / "model.safetensors")[k]) for k, v in load_file(inside / "model.safetensors").items())
    assert "actor/huggingface/model.safetensors" in json.loads((step / "manifest.json").read_text())["files"]


def test_export_refuses_a_damaged_checkpoint_in_one_line(tmp_path, tiny_config, capsys):
    trained(tmp_path, tiny_config)
    capsys.readouterr()
    step = tmp_path / "checkpoints" / "global_step_2"
    with open(step / "actor" / "model.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    assert main(["export", str(tmp_path / "checkpoints"), str(tmp_path / "out")]) == 2  # checkpoints/: the newest
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pt does not match its checksum" in err[0], err
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a plait actor checkpoint" in capsys.readouterr().err
    assert main(["export", str(step), str(tmp_path / "checkpoints")]) == 2  # never into a folder that holds files
    assert "exists and is not empty" in capsys.readouterr().err


def test_lora_export_merged_and_as_adapter(tmp_path, tiny_config):
    peft = pytest.importorskip("peft")
    trainer, batch = trained(tmp_path, tiny_config, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                             "actor_rollout_ref.actor.optim.lr=1e-2")
    actor: Actor = trainer.roles.actor.worker
    step = tmp_path / "checkpoints" / "global_step_2"
    want, _ = actor.compute_log_prob(batch, 8)
    assert main(["export", str(step), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    assert not any("lora" in k for k in merged.state_dict())
    got, _ = response_forward(merged, batch, 1.0, MicroBatching(8), with_entropy=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    assert main(["export", str(step), str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and (tmp_path / "adapter" / "tokenizer.json").is_file()
    base_dir = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    got, _ = response_forward(adapted, batch, 1.0, MicroBatching(8), with_entropy=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _shard_and_save(rank: int, model_dir: str, ckpt: str, rdzv: str) -> None:
    import torch.distributed as dist
    from plait.config import FsdpConfig
    from plait.models import load_causal_lm
    from plait.workers.parallel import full_state_dict, save_sharded, shard_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    model = load_causal_lm(model_dir)
    with torch.no_grad():  # weights that are not the saved model's: the shards must be what is exported
        for p in model.parameters():
            p.add_(0.01 * (torch.arange(p.numel()).reshape(p.shape) % 7))
    shard_model(model, model._no_split_modules, FsdpConfig(), "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    save_sharded(os.path.join(ckpt, "sharded", "actor", "sharded"), model, optimizer)
    whole = full_state_dict(model)
    if rank == 0:
        torch.save(whole, os.path.join(ckpt, "whole", "actor", "model.pt"))
    dist.destroy_process_group()


def test_sharded_checkpoint_exports_equal_to_its_unsharded_twin(tmp_path):
    import shutil
    import torch.multiprocessing as mp
    from plait.models import create_tiny_model
    model_dir = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    ckpt = tmp_path / "ckpt"
    for kind in ("sharded", "whole"):  # an actor checkpoint's layout: optim.pt and huggingface/ beside the weights
        hf = ckpt / kind / "actor" / "huggingface"
        hf.mkdir(parents=True)
        for name in os.listdir(model_dir):
            if not name.endswith(".safetensors"):
                shutil.copy2(os.path.join(model_dir, name), hf / name)
        torch.save({}, ckpt / kind / "actor" / "optim.pt")
    mp.spawn(_shard_and_save, args=(model_dir, str(ckpt), str(tmp_path / "rdzv")), nprocs=2)
    assert (ckpt / "sharded" / "actor" / "sharded" / "__1_0.distcp").is_file()
    for kind in ("sharded", "whole"):
        assert main(["export", str(ckpt / kind), str(tmp_path / f"out_{kind}")]) == 0
    sharded, whole = load_file(tmp_path / "out_sharded" / "model.safetensors"), load_file(tmp_path / "out_whole" / "model.safetensors")
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    assert any(not torch.equal(whole[k], original[k]) for k in whole)


def test_save_contents_without_what_a_resume_needs_still_saves_it(capsys):
    """verl's examples save only hf_model (gmpo); plait's checkpoint is always resumable: it writes
    model, optimizer and extra too, and says so in one line. A name plait does not know is refused."""
    from plait.config import load_config
    from plait.configtree import ConfigError
    cfg = load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"])
    assert cfg.actor_rollout_ref.actor.checkpoint.save_contents == ["model", "optimizer", "extra", "hf_model"]
    assert ("plait: actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']: plait's checkpoints always hold "
            "the model, optimizer and extra (what a resume needs), so they are written too") in capsys.readouterr().err
    with pytest.raises(ConfigError, match="each one of model, optimizer, extra, hf_model"):
        load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]"])
    with pytest.raises(ConfigError, match="each one of model, optimizer, extra, hf_model"):
        load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[weights]"])
