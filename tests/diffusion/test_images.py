"""Procedural glyphs, condition splits and the image rewards."""

import torch

from plait.data.images import IMAGE_REWARDS, NUM_GLYPHS, PROMPT_IMAGE_REWARDS, condition_split, render_glyphs
from plait.workers import diffusion_config


def test_the_torch_free_lists_config_checks_against_are_this_modules():
    """config accepts the names and glyph count workers/diffusion_config.py lists (torch-free); they are these."""
    assert diffusion_config.NUM_GLYPHS == NUM_GLYPHS
    assert diffusion_config.IMAGE_REWARD_NAMES == tuple(IMAGE_REWARDS)
    assert diffusion_config.PROMPT_IMAGE_REWARD_NAMES == tuple(PROMPT_IMAGE_REWARDS)


def test_glyphs_are_distinct_and_jittered():
    labels = torch.arange(NUM_GLYPHS)
    clean = render_glyphs(labels, 8, jitter=False)  # [10, 1, 8, 8]
    assert clean.shape == (NUM_GLYPHS, 1, 8, 8) and set(clean.unique().tolist()) == {-1.0, 1.0}
    assert len({tuple(img.flatten().tolist()) for img in clean}) == NUM_GLYPHS
    jittered = render_glyphs(labels.repeat(4), 16, channels=3, generator=torch.Generator().manual_seed(0))
    assert jittered.shape == (40, 3, 16, 16) and jittered.min() >= -1 and jittered.max() <= 1
    assert not torch.equal(jittered[:10], jittered[10:20])


def test_condition_splits_are_fixed_balanced_and_differ():
    train, val = condition_split("train", 100), condition_split("val", 100)
    assert torch.equal(train, condition_split("train", 100))
    assert torch.equal(torch.bincount(val), torch.full((NUM_GLYPHS,), 10)) and not torch.equal(train, val)


def test_verifiable_rewards_prefer_the_requested_class():
    labels = torch.arange(200) % NUM_GLYPHS
    images = render_glyphs(labels, 8, generator=torch.Generator().manual_seed(0))
    wrong = (labels + 1) % NUM_GLYPHS
    for name in ("glyph_classifier", "glyph_template"):
        right_score, wrong_score = IMAGE_REWARDS[name](images, labels), IMAGE_REWARDS[name](images, wrong)
        assert right_score.shape == (200,) and (right_score.mean() - wrong_score.mean()) > 0.1, name
    assert IMAGE_REWARDS["glyph_classifier"](images, labels).mean() > 0.9
    noise = torch.randn(200, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert IMAGE_REWARDS["glyph_classifier"](noise, labels).mean() < 0.5


def test_rule_rewards():
    black, white = -torch.ones(2, 1, 8, 8), torch.ones(2, 1, 8, 8)
    half = torch.cat([black[:, :, :4], white[:, :, 4:]], dim=2)  # [2, 1, 8, 8]
    cond = torch.zeros(2, dtype=torch.long)
    assert torch.equal(IMAGE_REWARDS["brightness"](black, cond), torch.zeros(2))
    assert torch.equal(IMAGE_REWARDS["brightness"](white * 3, cond), torch.ones(2))  # clamped to [-1, 1]
    assert torch.allclose(IMAGE_REWARDS["contrast"](half, cond), torch.ones(2))
    assert torch.equal(IMAGE_REWARDS["contrast"](white, cond), torch.zeros(2))
