"""vllm_prompt: a row's token ids and images as vLLM's input (no vLLM needed: the input is a plain dict)."""

import pytest

from plait.workers.vllm_engine import vllm_prompt

PAD = 262  # an image placeholder token
MEDIA = frozenset({PAD})


def test_each_run_of_placeholders_becomes_one_per_image():
    prompt = vllm_prompt([1, 5, PAD, PAD, PAD, PAD, 6, 7, PAD, PAD, 8], {"images": ["a", "b"]}, MEDIA)
    assert prompt == {"prompt_token_ids": [1, 5, PAD, 6, 7, PAD, 8], "multi_modal_data": {"image": ["a", "b"]}}


@pytest.mark.parametrize("media", [None, {}, {"images": [], "videos": []}])
def test_text_rows_pass_as_they_are(media):
    assert vllm_prompt([1, PAD, PAD, 3], media, MEDIA) == {"prompt_token_ids": [1, PAD, PAD, 3]}


def test_mismatches_and_videos_are_refused_in_one_line():
    with pytest.raises(ValueError, match="1 image placeholders and 2 images"):
        vllm_prompt([1, PAD, PAD, 6], {"images": ["a", "b"]}, MEDIA)
    with pytest.raises(ValueError, match="video inputs are not passed to vLLM; use rollout.name=hf"):
        vllm_prompt([1, PAD, 6], {"images": [], "videos": ["v"]}, MEDIA)
    with pytest.raises(ValueError, match="the model has no vision tower"):
        vllm_prompt([1, PAD, 6], {"images": ["a"]}, frozenset())
