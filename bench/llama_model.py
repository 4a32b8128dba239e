"""The benchmarks' larger model: a ~50M-parameter Llama-architecture decoder built from a config,
with plait's char tokenizer (nothing is downloaded). Sizes s and m stay plait's tiny Qwen2s."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plait.models import MAX_LENGTH, build_char_tokenizer, create_tiny_model

LLAMA_L = dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10, num_key_value_heads=5,
               intermediate_size=1728, rope_theta=10000.0)


def create_model(path: str | Path, size: str, seed: int = 0) -> str:
    """Sizes of plait.models.TINY_SIZES (Qwen2) or "l" (Llama, LLAMA_L); saved with the tokenizer."""
    if size != "l":
        return create_tiny_model(path, size, seed)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, dtype="float32", **LLAMA_L)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
