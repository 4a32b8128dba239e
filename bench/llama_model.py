"""The benchmarks' larger model: a ~50M-parameter Llama-architecture decoder built from a config,
with plait's char tokenizer (nothing is downloaded). Sizes s and m stay plait's tiny Qwen2s."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from plait.models import create_tiny_model, save_char_model

LLAMA_L = dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10, num_key_value_heads=5,
               intermediate_size=1728, rope_theta=10000.0)


def create_model(path: str | Path, size: str, seed: int = 0) -> str:
    """Sizes of plait.models.TINY_SIZES (Qwen2) or "l" (Llama, LLAMA_L); saved with the tokenizer."""
    if size != "l":
        return create_tiny_model(path, size, seed)
    return save_char_model(path, LlamaConfig, LlamaForCausalLM, LLAMA_L, seed)
