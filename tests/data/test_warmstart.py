import json
from pathlib import Path

import torch

from plait.data.warmstart import MARKER, sft_warmstart
from plait.models import load_causal_lm, load_tokenizer


def test_warmstart_trains_saves_and_caches(tiny_model_dir, tmp_path):
    out = tmp_path / "warm"
    assert sft_warmstart(tiny_model_dir, "arithmetic", out, steps=3, batch_size=8, lr=1e-2,
                         seed=0) == str(out)
    record = json.loads((out / MARKER).read_text())
    assert record["settings"]["steps"] == 3 and len(record["losses"]) == 3
    assert record["losses"][-1] < record["losses"][0]

    base, warm = load_causal_lm(tiny_model_dir).state_dict(), load_causal_lm(out).state_dict()
    assert base.keys() == warm.keys()
    assert all(not torch.equal(base[k], warm[k]) for k in base if k.endswith("q_proj.weight"))
    assert load_tokenizer(out).get_vocab() == load_tokenizer(tiny_model_dir).get_vocab()

    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert sft_warmstart(tiny_model_dir, "arithmetic", out, steps=3, batch_size=8, lr=1e-2,
                         seed=0) == str(out)
    assert weights.stat().st_mtime_ns == stamp  # cached: not trained or written again

    sft_warmstart(tiny_model_dir, "arithmetic", out, steps=2, batch_size=8, lr=1e-2, seed=0)
    assert weights.stat().st_mtime_ns != stamp  # other settings: trained again
    assert json.loads((out / MARKER).read_text())["settings"]["steps"] == 2


def test_warmstart_is_deterministic(tiny_model_dir, tmp_path):
    a = sft_warmstart(tiny_model_dir, "reverse", tmp_path / "a", steps=2, batch_size=4, lr=1e-2)
    b = sft_warmstart(tiny_model_dir, "reverse", tmp_path / "b", steps=2, batch_size=4, lr=1e-2)
    assert json.loads(Path(a, MARKER).read_text()) == json.loads(Path(b, MARKER).read_text())
