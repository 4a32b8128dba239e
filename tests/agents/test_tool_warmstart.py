"""The transcript warm start (plait/agents/warmstart.py) on the tiny built-in model: the loss is on the
assistant's tokens only while every token is attended, it trains, and it is cached."""

import json
import os

import pytest
import torch

from plait.agents.warmstart import transcript_examples, transcript_warmstart
from plait.data.warmstart import collate
from plait.models import create_tiny_model, load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), size="xs", seed=0)


def test_loss_on_assistant_tokens_only_tool_messages_attended(model_dir):
    tok = load_tokenizer(model_dir)
    examples = transcript_examples(tok, None, "gsm8k_synthetic_tools", 4, 0)
    ids, attention, labels = collate(examples, tok.pad_token_id)
    for row, (seq, mask) in enumerate(examples):
        n = len(seq)
        assert attention[row, :n].all() and not attention[row, n:].any()
        trained = tok.decode(labels[row][labels[row] != -100].tolist())
        assert trained.startswith('<tool_call>{"name": "calculator"') and trained.count(tok.eos_token) == 2
        answer = trained.split("#### ")[-1].replace(tok.eos_token, "")
        tool_turn = tok.decode(seq).split("</tool_call>" + tok.eos_token)[1]  # the tool message: attended, not trained
        assert tool_turn.lstrip().startswith(answer) and (labels[row] != -100).sum() == sum(mask) < n
    with pytest.raises(ValueError, match="no generated tool transcripts"):
        transcript_examples(tok, None, "gsm8k_synthetic", 4, 0)


def test_warmstart_trains_and_is_cached(model_dir, tmp_path):
    out = transcript_warmstart(model_dir, "gsm8k_synthetic_tools", tmp_path / "ws", steps=3, batch_size=2, lr=1e-3)
    marker = json.loads((tmp_path / "ws" / "warmstart.json").read_text())
    assert len(marker["losses"]) == 3
    before, after = load_causal_lm(model_dir).state_dict(), load_causal_lm(out).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    stamp = os.path.getmtime(tmp_path / "ws" / "warmstart.json")
    assert transcript_warmstart(model_dir, "gsm8k_synthetic_tools", tmp_path / "ws", steps=3, batch_size=2, lr=1e-3) == out
    assert os.path.getmtime(tmp_path / "ws" / "warmstart.json") == stamp  # not trained again
