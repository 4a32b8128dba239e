"""Qwen2-VL / Qwen2.5-VL through plait's passes: rope positions (verl's get_rope_index), padded and packed
log-probs equal to each row alone in HF's own forward, the hf engine's log-probs equal to the actor's,
and the model-folder checks."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from plait.config import ActorConfig, OptimConfig
from plait.configtree import ConfigError
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.types import RolloutBatch
from plait.models import check_model_dir, create_tiny_model, create_tiny_vl_model, load_causal_lm
from plait.models_vl import fetch_image, load_processor, rope_index, smart_resize, vl_inputs
from plait.workers.actor import Actor, freeze_vision_tower
from plait.workers.logprobs import response_logprobs
from plait.workers.packing import packing_works
from plait.workers.rollout_engine import SamplingParams, TransformersEngine

torch.set_num_threads(1)
KINDS = ["qwen2_5_vl", "qwen2_vl"]


def profiler(role: str):
    return ProfilerSession(GlobalProfilerConfig(), {role: RoleProfilerConfig()}, rank=0).for_role(role)


@pytest.fixture(scope="module", params=KINDS)
def vl(request, tmp_path_factory):
    path = create_tiny_vl_model(tmp_path_factory.mktemp(request.param) / "model", request.param, seed=0)
    return path, load_causal_lm(path).eval(), load_processor(path)


def prompts(processor, responses=((70, 71), (72,), (73, 74, 75))):
    """Three rows: one image, two images (the second twice), no image; each with a few response tokens."""
    red, blue = (fetch_image(Image.new("RGB", size, colour)) for size, colour in (((28, 28), (200, 0, 0)),
                                                                                   ((84, 56), (0, 0, 200))))
    ids, media = [], []
    for k, images in enumerate([[red], [blue, red], []]):
        messages = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                                 {"type": "text", "text": "colour?" * (k + 1)}]}]
        inputs = processor.images(images)
        ids.append(processor.tokens(processor.apply_chat_template(messages, add_generation_prompt=True), inputs))
        media.append(inputs)
    return ids, media, [list(r) for r in responses]


def padded(ids, responses):
    """[left-padded prompt | right-padded response] rows and their mask."""
    p, r = max(map(len, ids)), max(map(len, responses))
    rows = [[0] * (p - len(a)) + a + b + [0] * (r - len(b)) for a, b in zip(ids, responses)]
    mask = [[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (r - len(b)) for a, b in zip(ids, responses)]
    return torch.tensor(rows), torch.tensor(mask), r


def test_rope_index_is_verls_by_hand():
    """Text 0,1,2; a 1x2x3 image grid (merge 2 of 1x4x6 patches) from 3 on (t, h, w offsets); the text after
    the image at the image's largest position + 1; padding at 1."""
    class Cfg:
        image_token_id = 9

        class vision_config:
            spatial_merge_size = 2
    ids = torch.tensor([[0, 1, 2, 3] + [9] * 6 + [4, 5]])
    mask = torch.tensor([[0] + [1] * 11])
    pos = rope_index(ids, mask, [torch.tensor([[1, 4, 6]])], Cfg)
    assert pos[:, 0].tolist() == [[1, 0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                                  [1, 0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                                  [1, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]


def test_rope_index_matches_transformers(vl):
    _, model, processor = vl
    ids, media, responses = prompts(processor)
    inp, mask, _ = padded(ids, responses)
    ours = rope_index(inp, mask, [m.get("image_grid_thw") for m in media], model.config)  # [3, batch, len]
    grids = torch.cat([m["image_grid_thw"] for m in media if m])
    types = (inp == model.config.image_token_id).int()
    theirs, _ = model.model.get_rope_index(inp, types, image_grid_thw=grids, attention_mask=mask)
    assert torch.equal(ours[:, mask.bool()], theirs[:, mask.bool()])


@pytest.mark.parametrize("remove_padding", [False, True])
def test_log_probs_padded_and_packed_equal_each_row_alone(vl, remove_padding):
    _, model, processor = vl
    ids, media, responses = prompts(processor)
    inp, mask, resp_len = padded(ids, responses)
    with torch.no_grad():
        logp, _ = response_logprobs(model, inp, mask, resp_len, 1.0, False, remove_padding, media)
        for b, (prompt, response) in enumerate(zip(ids, responses)):
            one = torch.tensor([prompt + response])
            logits = model(input_ids=one, mm_token_type_ids=(one == model.config.image_token_id).int(),
                           **media[b]).logits[0, len(prompt) - 1:-1]  # HF's own positions
            # the image and video pads are never sampled, so they get no probability (models_vl.never_sampled)
            logits = logits.index_fill(-1, torch.tensor([model.config.image_token_id, model.config.video_token_id]),
                                       -float("inf")).log_softmax(-1)
            alone = logits.gather(-1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(logp[b, :len(response)], alone, atol=1e-5, rtol=1e-5)
    assert packing_works(model)  # the packed layout keeps sequences apart (4-row positions)


def test_images_change_the_log_probs(vl):
    _, model, processor = vl
    ids, media, responses = prompts(processor)
    inp, mask, resp_len = padded(ids, responses)
    other = [{**m, "pixel_values": m["pixel_values"].flip(0)} if m else m for m in media]
    with torch.no_grad():
        a, _ = response_logprobs(model, inp, mask, resp_len, 1.0, False, False, media)
        b, _ = response_logprobs(model, inp, mask, resp_len, 1.0, False, False, other)
    assert not torch.allclose(a[:2], b[:2]) and torch.equal(a[2], b[2])


def test_engine_log_probs_are_the_actors(vl):
    """The hf engine's sampled tokens scored again by the training forward (padded and packed) give the
    engine's log-probs: rollout_probs_diff is honest with images. Rows finish at different steps, so the
    decode loop also drops finished rows with their rope deltas."""
    _, model, processor = vl
    ids, media, _ = prompts(processor)
    eos = list(range(4, 100))  # many end ids: rows end at different steps
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=eos)
    gen = engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0.7),
                          generator=torch.Generator().manual_seed(3), multi_modal=media)
    pads = torch.tensor([model.config.image_token_id, model.config.video_token_id])
    assert not torch.isin(gen.responses, pads).any()  # one would take an image's features in every later forward
    responses = [r[m.bool()].tolist() for r, m in zip(gen.responses, gen.response_mask)]
    lengths = sorted(map(len, responses))
    assert lengths[1] < lengths[2] and len(lengths) == 3  # two rows ended first: the third decoded alone
    inp, mask, resp_len = padded(ids, responses)
    for remove_padding in (False, True):
        with torch.no_grad():
            logp, _ = response_logprobs(model, inp, mask, resp_len, 0.7, False, remove_padding, media)
        real = gen.response_mask.bool()[:, :resp_len]
        torch.testing.assert_close(logp[real], gen.logprobs[:, :resp_len][real], atol=1e-4, rtol=1e-4)


def test_vl_inputs_orders_pixels_as_packed(vl):
    _, model, processor = vl
    from plait.workers.packing import pack
    ids, media, responses = prompts(processor)
    inp, mask, _ = padded(ids, responses)
    packed = pack(inp, mask)  # longest first: row 1 (two images) before row 0
    out = vl_inputs(model.config, media, inp, mask, packed)
    assert out["position_ids"].shape == (4, *packed.input_ids.shape)
    assert torch.equal(out["image_grid_thw"], torch.cat([media[1]["image_grid_thw"], media[0]["image_grid_thw"]]))


def test_freeze_vision_tower(vl, tmp_path):
    path, _, _ = vl
    model = load_causal_lm(path)
    freeze_vision_tower(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in n for n in frozen)
    with pytest.raises(ConfigError, match="freeze_vision_tower=True: a qwen2 model has no vision tower"):
        freeze_vision_tower(load_causal_lm(create_tiny_model(tmp_path / "text", size="xs")))


def test_model_dir_checks_accept_qwen_vl_and_refuse_other_vlms_by_name(vl, tmp_path):
    path, _, _ = vl
    check_model_dir("actor_rollout_ref.model.path", path)
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava", "architectures": [
        "LlavaForConditionalGeneration"], "vision_config": {}, "text_config": {}}))
    with pytest.raises(ConfigError, match="a llava vision-language model: plait trains qwen2_vl and qwen2_5_vl"):
        check_model_dir("actor_rollout_ref.model.path", other)
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in Path(path).iterdir():
        if item.name != "preprocessor_config.json":
            (bare / item.name).symlink_to(item)
    with pytest.raises(ConfigError, match=r"no image processor \(preprocessor_config.json\)"):
        check_model_dir("actor_rollout_ref.model.path", bare)


def test_images_resize_as_verls_process_image(tmp_path):
    assert smart_resize(28, 28, 28, 4 * 28 * 28, 16384 * 28 * 28) == (56, 56)       # up to min_pixels
    assert smart_resize(100, 300, 28, 4 * 28 * 28, 28 * 28 * 8) == (28, 112)        # down to max_pixels
    Image.new("RGB", (60, 30), (1, 2, 3)).save(tmp_path / "a.png")
    image = fetch_image({"path": "a.png", "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4}, 14, tmp_path)
    assert image.mode == "RGB" and image.size == (56, 28)
    with pytest.raises(ValueError, match="an image does not decode"):
        fetch_image({"bytes": b"not an image"})


def vl_batch(processor, n=2):
    """A RolloutBatch of the three rows, each sampled `n` times (adjacent, as the rollout makes them)."""
    ids, media, responses = prompts(processor, ((70, 71, 5), (72,), (73, 74, 75, 76)))
    ids, media, responses = ([x for x in xs for _ in range(n)] for xs in (ids, media, responses))
    p, r = max(map(len, ids)), max(map(len, responses))
    mask = torch.tensor([[1.0] * len(b) + [0.0] * (r - len(b)) for b in responses])
    rows = len(ids)
    return RolloutBatch(
        prompts=torch.tensor([[0] * (p - len(a)) + a for a in ids]),
        prompt_mask=torch.tensor([[0] * (p - len(a)) + [1] * len(a) for a in ids]),
        responses=torch.tensor([b + [0] * (r - len(b)) for b in responses]), response_mask=mask,
        rollout_logprobs=torch.zeros(rows, r), group_ids=torch.arange(rows) // n, versions=torch.zeros(rows, dtype=torch.long),
        data_sources=["x"] * rows, ground_truths=["1"] * rows, extra_infos=[{}] * rows, stop_reasons=["eos"] * rows,
        advantages=torch.linspace(-1, 1, rows)[:, None].expand(rows, r).contiguous() * mask,
        multi_modal_inputs=media)


@pytest.mark.parametrize("kind", KINDS)
def test_micro_batches_dynamic_bsz_and_packing_agree(kind, tmp_path):
    """Old log-probs in any layout (fixed micro-batches, token-budget bins, packed) are one set of numbers, and
    one update packed equals one padded: the images follow the rows through every split."""
    path = create_tiny_vl_model(tmp_path / kind, kind, seed=1)
    batch = vl_batch(load_processor(path))
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.0), ppo_mini_batch_size=3,
                      ppo_micro_batch_size_per_gpu=2)
    actors = {pad: Actor(path, cfg, 2, 1.0, profiler("actor"), remove_padding=pad, max_token_len=max_tokens)
              for pad, max_tokens in ((False, None), (True, 60))}
    reference, _ = actors[False].compute_log_prob(batch, micro_batch_size=6)
    for actor, micro, budget in ((actors[False], 1, None), (actors[True], 4, None), (actors[True], 6, 50)):
        logp, _ = actor.compute_log_prob(batch, micro_batch_size=micro, max_token_len=budget)
        torch.testing.assert_close(logp, reference, atol=1e-5, rtol=1e-5)
    batch = batch.replace(old_logprobs=reference)
    for actor in actors.values():
        actor.update(batch)
    padded, packed = (actors[k].state_dict() for k in (False, True))
    assert any(not torch.equal(padded[k], Actor(path, cfg, 2, 1.0, profiler("actor")).state_dict()[k])
               for k in padded if ".visual." in k)
    for k in padded:  # Adam divides by sqrt(v): a near-zero gradient's rounding moves a weight by up to ~1e-5
        torch.testing.assert_close(packed[k], padded[k], atol=1e-4, rtol=1e-4)
