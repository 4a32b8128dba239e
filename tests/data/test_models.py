import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from plait.models import (TINY_SIZES, build_char_tokenizer, create_tiny_model, eos_token_ids,
                          load_causal_lm, load_tokenizer)

ASCII = "".join(chr(c) for c in range(32, 127)) + "\n"
TEXTS = [ASCII, "12+7=19", "a , b . c ! ? it's", "  two  spaces\n\nnewlines ", "héllo ✓\t"]


def test_char_tokenizer_round_trips_text_one_token_per_char():
    tok = build_char_tokenizer()
    assert len(tok) == 4 + 256
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text.encode())  # no bos/eos added, one id per byte
        assert tok.decode(ids) == text
    assert len(set(tok(ASCII)["input_ids"])) == len(ASCII)
    with_eos = tok("ab")["input_ids"] + [tok.eos_token_id]
    assert tok.decode(with_eos, skip_special_tokens=True) == "ab"


def test_chat_template_is_compact():
    tok = build_char_tokenizer()
    messages = [{"role": "user", "content": "12+7="}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "12+7=\n"
    two = messages + [{"role": "assistant", "content": "19"}]
    assert tok.apply_chat_template(two, tokenize=False) == "12+7=\n19\n"


def test_tiny_model_saves_and_loads_deterministically(tmp_path):
    path = create_tiny_model(tmp_path / "a", size="xs", seed=3)
    model, tok = load_causal_lm(path), load_tokenizer(path)
    assert model.config.hidden_size == TINY_SIZES["xs"]["hidden_size"] == 64
    assert model.config.vocab_size == len(tok) == 260 and model.dtype == torch.float32
    # The tokenizer loaded back (transformers picks Qwen2Tokenizer) encodes like the one built.
    built = build_char_tokenizer()
    for text in TEXTS:
        assert tok(text)["input_ids"] == built(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.padding_side == "left" and tok.chat_template == built.chat_template
    batch = tok(["1+1=", "10+20="], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]  # left padding
    assert model(**batch).logits.shape == (2, 6, 260)

    same = load_causal_lm(create_tiny_model(tmp_path / "b", size="xs", seed=3)).state_dict()
    other = load_causal_lm(create_tiny_model(tmp_path / "c", size="xs", seed=4)).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())
    assert not torch.equal(model.state_dict()["lm_head.weight"], other["lm_head.weight"])


def test_unknown_size_and_missing_directory_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'xl'.*xs, s, m"):
        create_tiny_model(tmp_path, size="xl")
    # A hub id is not a local directory: refused without touching the network.
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen2-0.5B.*never downloads"):
        load_causal_lm("Qwen/Qwen2-0.5B")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer(tmp_path / "missing")


def test_any_causal_lm_loads_and_eos_ids_merge(tmp_path):
    # Another architecture, a tokenizer without a pad token, a generation config with two eos ids.
    tok = build_char_tokenizer()
    tok.pad_token = None
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok)))
    model.generation_config.eos_token_id = [5, tok.eos_token_id]
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    loaded_tok, loaded = load_tokenizer(tmp_path), load_causal_lm(tmp_path)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded_tok.pad_token_id == loaded_tok.eos_token_id == 2
    assert eos_token_ids(loaded_tok, loaded.generation_config) == [2, 5]
    loaded.generation_config.eos_token_id = None
    assert eos_token_ids(loaded_tok, loaded.generation_config) == [2]
