"""VLLMEngine with images (rollout.name=vllm, a vision-language model) against a float32 Hugging Face
forward with the same pixel values: the rollout log-probs are the model's (rollout_probs_diff stays
honest for VL), each row sees its own image, and weight loads reach the vision tower too.

The models are tiny Qwen2-VL and Qwen2.5-VL built here from a config (random weights, a one- or
two-block vision tower of width 64, the char tokenizer with Qwen's vision tokens), saved with their
image processor. vLLM 0.32's Qwen2-VL code imports torchvision, and transformers builds no Qwen2-VL
processor without it: on CPU that is torchvision's CPU build; without one these tests skip, naming it.
"""

import pytest
import torch

from plait.config import RolloutConfig
from plait.data.tasks import make_task_rows
from plait.workers.rollout_engine import SamplingParams

pytest.importorskip("vllm")
pytest.importorskip("torchvision", reason="vLLM 0.32's Qwen2-VL imports torchvision: install its CPU build "
                    "(torchvision==0.28.0+cpu for torch 2.13.0+cpu) beside vLLM", exc_type=ImportError)
pytestmark = pytest.mark.vllm

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# One message per line, an image as Qwen's vision tokens: the char model reads every template character.
TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")
VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                       window_size=56, fullatt_block_indexes=[1]),
}


def build_tiny_vl(path, kind: str) -> str:
    """A tiny `kind` model (text: head size 32, vLLM-CPU's smallest; M-RoPE sections 4/6/6) with its processor files."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor)
    from plait.models import build_char_tokenizer
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    token = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=128, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config_cls, model_cls = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
                             "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)}[kind]
    vision = dict(VISION[kind], patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = config_cls(text_config=text, vision_config=vision, image_token_id=token["<|image_pad|>"],
                        video_token_id=token["<|video_pad|>"], vision_start_token_id=token["<|vision_start|>"],
                        vision_end_token_id=token["<|vision_end|>"], tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model_cls(config).save_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    """(model path, engine) for each architecture; one engine per module and architecture."""
    from plait.workers.vllm_engine import VLLMEngine
    path = build_tiny_vl(tmp_path_factory.mktemp(request.param) / "model", request.param)
    engine = VLLMEngine(path, RolloutConfig(name="vllm", dtype="float32", max_model_len=512), torch.float32, "cpu",
                        eos_token_ids=[2], ignore_eos=False)
    yield path, engine
    engine.close()


def image_rows(n: int):
    """The larger_shape task's rows and their images."""
    import io

    from PIL import Image
    rows = make_task_rows("larger_shape", "test", n, seed=0)
    images = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows]
    return rows, images


def encode(path, row, image):
    """The row's prompt as the dataset gives it (placeholders expanded by the processor) and the pixel values."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(path)
    question = row["prompt"][0]["content"].replace("<image>", "")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                         add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[image], return_tensors="pt")


def hf_logprobs(model, enc, tokens, temperature):
    """log softmax(logits / T) of `tokens` after the prompt, teacher-forced with the image: [len(tokens)]."""
    prompt = enc["input_ids"][0].tolist()
    ids = torch.tensor([prompt + tokens])
    # transformers 5.19 places M-RoPE's image positions by the processor's token types (0: text)
    types = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=enc["pixel_values"],
                       image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=types).logits
    logits = logits[0, len(prompt) - 1:-1].float() / temperature  # [len(tokens), vocab]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def rows_of(out):
    for i in range(len(out.stop_reasons)):
        n = int(out.response_mask[i].sum())
        yield out.responses[i, :n].tolist(), out.logprobs[i, :n]


def load_model(path, scale=0.0, seed=0):
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def check_against_forward(engine, path, model, temperature=0.7):
    rows, images = image_rows(4)
    encs = [encode(path, r, im) for r, im in zip(rows, images)]
    prompts = [e["input_ids"][0].tolist() for e in encs]
    assert all(p.count(min(engine.media_tokens)) == 4 for p in prompts)  # 56 x 56 pixels: 4 placeholders
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=temperature),
                          torch.Generator().manual_seed(0), multi_modal=[{"images": [im]} for im in images])
    worst, other = 0.0, []
    for i, (tokens, logp) in enumerate(rows_of(out)):
        assert tokens
        worst = max(worst, float((hf_logprobs(model, encs[i], tokens, temperature) - logp).abs().max()))
        wrong = dict(encs[i], pixel_values=encs[i - 1]["pixel_values"])  # the previous row's image
        other.append(float((hf_logprobs(model, wrong, tokens, temperature) - logp).abs().max()))
    assert worst < 1e-4, f"vLLM's log-probs differ from the forward's with the same image by {worst}"
    assert min(other) > 10 * worst, f"another image's log-probs are as close ({other}): the images did not count"
    return worst


def test_log_probs_with_images_match_a_float32_forward(vl):
    path, engine = vl
    check_against_forward(engine, path, load_model(path))


def test_text_rows_and_placeholder_checks(vl):
    from plait.workers.vllm_engine import vllm_prompt
    path, engine = vl
    out = engine.generate([[1, 40, 41]], SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0), multi_modal=[{}])
    assert out.response_mask.sum() > 0
    pad = min(engine.media_tokens)
    cut = vllm_prompt([1, 5, pad, pad, pad, pad, 6, 7], {"images": ["img"]}, engine.media_tokens)
    assert cut["prompt_token_ids"] == [1, 5, pad, 6, 7] and cut["multi_modal_data"] == {"image": ["img"]}
    with pytest.raises(ValueError, match="1 image placeholders and 2 images"):
        vllm_prompt([1, pad, pad, 6], {"images": ["a", "b"]}, engine.media_tokens)
    with pytest.raises(ValueError, match="video inputs are not passed to vLLM"):
        vllm_prompt([1, pad, 6], {"images": [], "videos": ["v"]}, engine.media_tokens)


def test_weight_loads_reach_the_vision_tower(vl):
    """After a load of perturbed weights (vision tower included), the log-probs are the new model's."""
    path, engine = vl
    model = load_model(path, scale=0.05, seed=3)
    engine.load_weights(model.state_dict())
    check_against_forward(engine, path, model)
