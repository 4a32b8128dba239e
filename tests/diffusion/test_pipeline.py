"""Flow-GRPO on a whole text-to-image pipeline: a tiny SD3 pipeline built from configs, saved with
save_pretrained and loaded back from its folder as a user's would be (nothing downloaded)."""

import gzip
import json
import math
import os
import pickle
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from PIL import Image  # noqa: E402

from plait import driver  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.configtree import ConfigError  # noqa: E402
from plait.data.images import clip_score, jpeg_compressibility, jpeg_incompressibility  # noqa: E402
from plait.data.prompts import load_prompts  # noqa: E402
from plait.profiler import read_manifest  # noqa: E402
from plait.trainers.lifecycle import read_metrics  # noqa: E402
from plait.workers.diffusers_policy import LoraConfig  # noqa: E402
from plait.workers.diffusion import DiffusionActor, DiffusionActorConfig, sample_with_logprobs  # noqa: E402
from plait.workers.diffusion_pipeline import (PipelineConfig, create_tiny_sd3_pipeline,  # noqa: E402
                                              load_pipeline_policy)

PROMPTS = ["a red cat", "a blue dog", "green hills", "a city at night", "an apple", "the sea", "a bird", "snow"]


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    return create_tiny_sd3_pipeline(tmp_path_factory.mktemp("tiny_sd3"), seed=0)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "tag": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def tiny_config(out_dir, pipeline_dir, prompt_file, *overrides):
    return load_config(None, [
        "trainer.mode=diffusion", f"data.train_files=[{prompt_file}]", "data.train_batch_size=2", "data.val_size=4",
        "actor_rollout_ref.rollout.n=4", "trainer.test_freq=-1", "trainer.logger=[]",
        f"trainer.default_local_dir={out_dir}", f"diffusion.model_path={pipeline_dir}",
        "diffusion.reward=jpeg_compressibility", "diffusion.actor.num_inference_steps=6",
        "diffusion.actor.sde_window_range=[0,6]", "diffusion.actor.sde_window_size=2", *overrides])


def test_folder_loads_and_unsupported_folders_are_refused(pipeline_dir, prompt_file, tmp_path):
    assert {"model_index.json", "transformer", "vae", "text_encoder", "tokenizer_2"} <= set(os.listdir(pipeline_dir))
    policy = load_pipeline_policy(pipeline_dir, PipelineConfig())
    assert (policy.cfg.image_size, policy.cfg.channels, policy.cfg.shift) == (16, 4, 3.0)
    assert [name for name, _ in policy.named_children()] == ["transformer"]  # frozen parts are not submodules

    flux = tmp_path / "flux"
    shutil.copytree(pipeline_dir, flux)
    index = json.loads((flux / "model_index.json").read_text())
    (flux / "model_index.json").write_text(json.dumps(index | {"_class_name": "FluxPipeline"}))
    with pytest.raises(ConfigError, match=r"diffusion\.model_path.*FluxPipeline.*packs latents"):
        driver.build(tiny_config(tmp_path / "a", flux, prompt_file), progress=False)
    shutil.rmtree(flux / "vae")
    (flux / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="lacks vae"):
        driver.build(tiny_config(tmp_path / "b", flux, prompt_file), progress=False)
    with pytest.raises(ConfigError, match=r"data\.train_files"):
        driver.build(tiny_config(tmp_path / "c", pipeline_dir, prompt_file, "data.train_files=null"), progress=False)
    with pytest.raises(ConfigError, match=r"diffusion\.reward"):
        driver.build(tiny_config(tmp_path / "d", pipeline_dir, prompt_file, "diffusion.reward=brightness"),
                     progress=False)


def test_prompts_are_encoded_once_and_cached_only_when_asked(pipeline_dir):
    policy = load_pipeline_policy(pipeline_dir, PipelineConfig(negative_prompt="blurry"))
    cond = policy.encode(["a cat", "a dog", "a cat"])
    assert cond.embeds.shape == (3, 77 + 128, 32) and cond.pooled.shape == (3, 32)
    assert torch.equal(cond.embeds[0], cond.embeds[2]) and not torch.equal(cond.embeds[0], cond.embeds[1])
    assert torch.equal(cond.neg_embeds[0], policy.negative[0][0]) and policy.cache == {}
    again = policy.encode(["a dog"], cache=True)
    assert list(policy.cache) == ["a dog"] and torch.equal(again.embeds[0], cond.embeds[1])


def test_guided_sampler_logprobs_match_a_direct_evaluation(pipeline_dir):
    g, noise_level = 3.0, 0.8
    policy = load_pipeline_policy(pipeline_dir, PipelineConfig(guidance_scale=g, negative_prompt="dull"))
    cond = policy.encode(["a red cat", "snow", "a red cat"])
    traj = sample_with_logprobs(policy, cond, 6, noise_level, torch.Generator().manual_seed(0), (1, 4), shift=3.0)
    s = 5 / 6  # the second grid point, shifted as SD3's scheduler does
    assert traj.timesteps[1].item() == pytest.approx(3 * s / (1 + 2 * s))

    def velocity(x, t, embeds, pooled):  # one branch at a time, unbatched
        return policy.transformer(hidden_states=x, timestep=torch.full((len(x),), 1000 * t), encoder_hidden_states=embeds,
                                  pooled_projections=pooled, return_dict=False)[0]

    with torch.no_grad():
        for i in range(1, 4):
            t, t_prev = traj.timesteps[i].item(), traj.timesteps[i + 1].item()
            x, x_prev = traj.latents[:, i], traj.latents[:, i + 1]
            v_u, v_c = velocity(x, t, cond.neg_embeds, cond.neg_pooled), velocity(x, t, cond.embeds, cond.pooled)
            v = v_u + g * (v_c - v_u)
            sigma, dt = noise_level * math.sqrt(t / (1 - t)), t_prev - t
            mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
            direct = torch.distributions.Normal(mean, sigma * math.sqrt(-dt)).log_prob(x_prev).mean(dim=(1, 2, 3))
            assert torch.allclose(traj.log_probs[:, i], direct, atol=1e-4)
            assert not torch.allclose(v, v_c, atol=1e-3)  # guidance changed the velocity
    assert (traj.log_probs[:, [0, 4, 5]] == 0).all()


def test_image_rewards(tmp_path):
    flat, busy = torch.full((2, 3, 32, 32), 0.5), torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert (jpeg_compressibility(flat, ["a"] * 2, [{}] * 2) > jpeg_compressibility(busy, ["a"] * 2, [{}] * 2)).all()
    assert torch.equal(jpeg_incompressibility(busy, [], []), -jpeg_compressibility(busy, [], []))
    assert jpeg_incompressibility(busy[:, :1], [], []).shape == (2,)  # grey images too

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    # A tiny CLIP folder: the pipeline's tokenizer, a random model, the default image processor.
    pipe = create_tiny_sd3_pipeline(tmp_path / "pipe", seed=0)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=dict(vocab_size=514, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=1),
                                 vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=32, patch_size=8),
                                 projection_dim=16))
    model.save_pretrained(tmp_path / "clip")
    shutil.copytree(pipe / "tokenizer", tmp_path / "clip", dirs_exist_ok=True)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(tmp_path / "clip")
    score = clip_score(str(tmp_path / "clip"))
    a = score(busy, ["a cat", "a dog"], [{}, {}])
    assert a.shape == (2,) and (a.abs() <= 1).all() and a[0] != a[1]
    assert not torch.allclose(a, score(busy, ["snow", "snow"], [{}, {}]))


def test_prompt_rows_keep_metadata(prompt_file, tmp_path):
    rows = load_prompts(prompt_file)
    assert rows[1].prompt == "a blue dog" and rows[1].metadata == {"tag": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="'prompt'"):
        load_prompts(bad)


def test_lower_precision_frozen_parts_with_float32_adapters(pipeline_dir, profiler):
    lora = LoraConfig(enable=True, r=4)
    actor = DiffusionActor(pipeline_dir, DiffusionActorConfig(num_inference_steps=3, sde_window_range=(0, 3),
                                                              sde_window_size=1),
                           profiler, lora=lora, pipeline=PipelineConfig(dtype="bfloat16"))
    pipe = actor.model.pipe
    assert pipe.vae.dtype == pipe.text_encoder.dtype == torch.bfloat16
    assert {p.dtype for p in actor.params} == {torch.float32}
    assert {p.dtype for n, p in actor.model.transformer.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    traj = actor.generate(["a cat", "a dog"], torch.Generator().manual_seed(0))
    assert traj.images.shape == (2, 3, 32, 32) and traj.images.dtype == torch.float32
    assert torch.isfinite(traj.window_log_probs).all()


def _trainable(lifecycle):
    return {k: v.clone() for k, v in lifecycle.trainer.actor.call(DiffusionActor.state_dict)["model"].items()}


def test_lora_trains_end_to_end_saves_images_and_resumes(tmp_path, pipeline_dir, prompt_file):
    common = ["diffusion.lora.enable=true", "diffusion.lora.r=4", "diffusion.actor.lr=1e-2", "trainer.save_freq=2",
              "diffusion.actor.kl_loss_coef=0.01"]
    full, part = tmp_path / "full", tmp_path / "part"
    lifecycle = driver.build(tiny_config(full, pipeline_dir, prompt_file, "trainer.total_training_steps=4",
                                         "trainer.test_freq=2", "trainer.logger=[tensorboard]", *common), progress=False)
    assert lifecycle.trainer.ref is None  # with LoRA the reference is the actor, adapters off
    base = {k: v.clone() for k, v in lifecycle.trainer.actor.call(lambda a: a.model.state_dict()).items()}
    before = _trainable(lifecycle)
    lifecycle.run()
    after = _trainable(lifecycle)
    assert before.keys() and all("lora_" in k for k in before)  # what trains, and what a checkpoint holds
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)
    model = lifecycle.trainer.actor.call(lambda a: a.model.state_dict())
    assert all(torch.equal(base[k], model[k]) for k in base if "lora_" not in k)  # the base never moves
    ckpt = torch.load(full / "checkpoints" / "global_step_4" / "actor" / "model_and_optimizer.pt", weights_only=True)
    assert ckpt["model"].keys() == after.keys()

    records = read_metrics(os.path.join(full, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all(r["training/rollout_logprob_diff_mean"] < 1e-4 for r in records[1:])
    assert records[2]["actor/kl_loss"] > 0  # the adapters moved the policy away from the base
    assert {"val-core/jpeg_compressibility/reward/mean", "val-aux/jpeg_incompressibility/reward/mean"} <= set(records[2])
    assert sorted(os.listdir(full / "val_images")) == ["step_0.png", "step_2.png", "step_4.png"]
    assert Image.open(full / "val_images" / "step_2.png").size == (2 + 2 * 34, 2 + 2 * 34)  # 4 images of 32 px, 2x2
    assert any(f.startswith("events.") for f in os.listdir(full / "tensorboard"))

    for steps in (2, 4):
        driver.build(tiny_config(part, pipeline_dir, prompt_file, f"trainer.total_training_steps={steps}", *common),
                     progress=False).run()
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing", "perf/", "memory/", "val-"))}  # noqa: E731
    resumed = read_metrics(os.path.join(part, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert strip(records[4]) == pytest.approx(strip(resumed[3]), rel=1e-4, abs=1e-6)


def test_compressibility_reward_rises(tmp_path, pipeline_dir, prompt_file):
    """The planted easy reward: JPEG compressibility of the decoded images, held-out ODE samples."""
    run = tiny_config(tmp_path, pipeline_dir, prompt_file, "trainer.total_training_steps=24", "trainer.test_freq=24",
                      "diffusion.actor.lr=1e-2", "diffusion.actor.kl_loss_coef=0", "diffusion.actor.sde_window_size=3")
    driver.build(run, progress=False).run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    key = "val-core/jpeg_compressibility/reward/mean"
    before, after = records[0][key], records[-1][key]
    print(f"held-out jpeg_compressibility {before:.3f} -> {after:.3f} in 24 steps")
    assert after > before + 0.05, (before, after)


@pytest.mark.parametrize("tool", ["torch", "torch_memory"])
def test_profiling_step1_sees_every_pipeline_stage(tmp_path, pipeline_dir, prompt_file, tool):
    """The profiler-matrix entry for the pipeline variant: step 1 of 2, LoRA with its adapter-off reference."""
    save = tmp_path / "profile"
    driver.build(tiny_config(tmp_path / "out", pipeline_dir, prompt_file, "trainer.total_training_steps=2",
                             "diffusion.lora.enable=true", f"global_profiler.tool={tool}", "global_profiler.steps=[1]",
                             f"global_profiler.save_path={save}", "actor_rollout_ref.actor.profiler.enable=true"),
                 progress=False).run()
    ext = "pickle" if tool == "torch_memory" and torch.cuda.is_available() else "pt.trace.json.gz"
    [record] = read_manifest(str(save))
    assert (record["steps"], record["role"], record["path"], record["complete"]) == (
        [1, 1], "actor", f"step1/actor_rank0.{ext}", True)
    assert sorted(os.listdir(save)) == ["manifest.jsonl", "step1"]
    if ext == "pickle":
        with open(save / record["path"], "rb") as f:
            names = str(pickle.load(f)["external_annotations"])
    else:
        with gzip.open(save / record["path"]) as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
    for stage in ("gen", "encode", "decode", "old_log_prob", "ref", "update_actor"):
        assert f"actor/{stage}" in names, stage


def test_full_fine_tune_with_kl_uses_a_frozen_reference_copy(tmp_path, pipeline_dir, prompt_file):
    lifecycle = driver.build(tiny_config(tmp_path, pipeline_dir, prompt_file, "trainer.total_training_steps=2",
                                         "diffusion.actor.kl_loss_coef=0.01", "diffusion.actor.lr=1e-2"), progress=False)
    assert lifecycle.trainer.ref is not None
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert records[0]["actor/kl_loss"] == pytest.approx(0, abs=1e-9)  # step 1 starts at the reference
    assert records[1]["actor/kl_loss"] > 0
    state = lifecycle.trainer.actor.call(DiffusionActor.state_dict)["model"]
    assert any(k.startswith("transformer.transformer_blocks") for k in state)  # every transformer weight trains


@pytest.mark.gpu
def test_cuda_bfloat16_offloaded_pipeline_trains(tmp_path, pipeline_dir, prompt_file):
    lifecycle = driver.build(tiny_config(tmp_path, pipeline_dir, prompt_file, "trainer.device=cuda",
                                         "trainer.total_training_steps=2", "diffusion.lora.enable=true",
                                         "diffusion.pipeline.dtype=bfloat16", "diffusion.pipeline.offload=true"),
                             progress=False)
    lifecycle.run()
    pipe = lifecycle.trainer.actor.call(lambda a: a.model.pipe)
    assert pipe.text_encoder.device.type == "cpu" and pipe.vae.device.type == "cpu"  # parked between uses
    assert pipe.transformer.device.type == "cuda"
    last = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))[-1]
    assert last["perf/max_memory_allocated_gb"] > 0 and last["training/rollout_logprob_diff_mean"] < 1e-2


def test_user_reward_file_gets_images_prompts_and_metadata(tmp_path, pipeline_dir, prompt_file):
    seen = tmp_path / "seen.jsonl"
    reward = tmp_path / "reward.py"
    reward.write_text(f'''import json
def brightness(images, prompts, metadata):
    with open({str(seen)!r}, "a") as f:
        f.write(json.dumps({{"shape": list(images.shape), "prompts": prompts, "metadata": metadata}}) + "\\n")
    return images.mean(dim=(1, 2, 3))
''')
    driver.build(tiny_config(tmp_path / "out", pipeline_dir, prompt_file, "trainer.total_training_steps=1",
                             f"custom_reward_function.path={reward}", "custom_reward_function.name=brightness"),
                 progress=False).run()
    [call] = [json.loads(line) for line in seen.read_text().splitlines()]
    assert call["shape"] == [8, 3, 32, 32]  # 2 prompts x rollout.n=4, decoded by the VAE
    assert call["prompts"] == ["a red cat"] * 4 + ["a blue dog"] * 4
    assert call["metadata"] == [{"tag": 0}] * 4 + [{"tag": 1}] * 4
    record = read_metrics(os.path.join(tmp_path, "out", "metrics.jsonl"))[-1]
    assert 0 < record["critic/score/mean"] < 1
