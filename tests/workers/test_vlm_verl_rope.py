"""Side by side with verl 0.9.1's get_rope_index (verl/models/transformers/qwen2_vl.py): the function is
read from verl's file and run on 300 random rows (0-3 images of random grids, left padding); plait's
rope_index must give the same [3, len] positions.

    pip download verl==0.9.1 --no-deps && unzip the wheel into DIR   (or the agent parity's side directory)
    PLAIT_VERL_SITE=DIR pytest tests/workers/test_vlm_verl_rope.py

Only that one function is executed (importing verl's module would pull its CUDA-side dependencies).
Without PLAIT_VERL_SITE the test skips, naming it.
"""

import ast
import os
import random
from pathlib import Path
from typing import Optional

import pytest
import torch

from plait.models import create_tiny_vl_model, load_causal_lm
from plait.models_vl import load_processor, rope_index

VERL_FILE = Path(os.environ.get("PLAIT_VERL_SITE", "/nonexistent")) / "verl" / "models" / "transformers" / "qwen2_vl.py"
pytestmark = pytest.mark.skipif(not VERL_FILE.is_file(), reason="verl 0.9.1 side directory not given: set "
                                "PLAIT_VERL_SITE (see this file's docstring)")


def verl_get_rope_index():
    tree = ast.parse(VERL_FILE.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_rope_index")
    scope = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module([fn], []), str(VERL_FILE), "exec"), scope)
    return scope["get_rope_index"]


def test_rope_index_equals_verls(tmp_path):
    path = create_tiny_vl_model(tmp_path / "model", "qwen2_5_vl")
    processor, config = load_processor(path), load_causal_lm(path).config
    verl = verl_get_rope_index()
    token = processor.tokenizer.convert_tokens_to_ids
    rng = random.Random(0)
    for _ in range(300):
        seq, grids = [], []
        for _ in range(rng.randint(0, 3)):
            t, h, w = 1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)
            seq += [rng.randint(10, 200) for _ in range(rng.randint(0, 5))]
            seq += [token("<|vision_start|>")] + [token("<|image_pad|>")] * (h * w // 4) + [token("<|vision_end|>")]
            grids.append([t, h, w])
        seq += [rng.randint(10, 200) for _ in range(rng.randint(1, 6))]
        pad = rng.randint(0, 4)
        ids, mask = torch.tensor([0] * pad + seq), torch.tensor([0] * pad + [1] * len(seq))
        grid = torch.tensor(grids) if grids else None
        theirs = verl(processor, ids, image_grid_thw=grid, attention_mask=mask)   # [3, len]
        assert torch.equal(rope_index(ids[None], mask[None], [grid], config)[:, 0], theirs)
