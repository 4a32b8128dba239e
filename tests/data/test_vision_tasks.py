"""The generated-image tasks (plait/data/vision_tasks.py): rows in verl's geo3k layout whose answers
are checked against the pixels, their parquet files, and their rewards."""

import io
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from plait.data.rewards import default_compute_score
from plait.data.tasks import IMAGES_TYPE, make_task_rows, write_task_files
from plait.data.vision_tasks import GEO3K_INSTRUCTION, SIZE

VISION_TASKS = ["larger_shape", "count_dots", "geo3k_synthetic"]


def pixels(row: dict) -> np.ndarray:
    (image,) = row["images"]
    decoded = Image.open(io.BytesIO(image["bytes"]))
    assert decoded.format == "PNG" and decoded.mode == "RGB" and image["path"] is None
    return np.asarray(decoded).astype(int)  # [H, W, 3]


@pytest.mark.parametrize("task", VISION_TASKS)
def test_rows_have_one_image_per_placeholder_in_verls_layout(task):
    for i, row in enumerate(make_task_rows(task, "train", 40, seed=0)):
        assert set(row) == {"data_source", "prompt", "images", "ability", "reward_model", "extra_info"}
        (turn,) = row["prompt"]
        assert turn["role"] == "user" and turn["content"].startswith("<image>")
        assert turn["content"].count("<image>") == len(row["images"]) == 1
        assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == i
        assert pixels(row).shape == ((SIZE, SIZE, 3) if task != "geo3k_synthetic" else (112, 112, 3))


def test_larger_shape_answer_is_the_colour_with_more_pixels():
    rows = make_task_rows("larger_shape", "train", 200, seed=0)
    for row in rows:
        rgb = pixels(row)
        red = ((rgb[..., 0] > 150) & (rgb[..., 2] < 100)).sum()
        blue = ((rgb[..., 2] > 150) & (rgb[..., 0] < 100)).sum()
        assert min(red, blue) > 0 and max(red, blue) >= 2 * min(red, blue)  # sides 1.5x apart: areas 2.25x
        assert row["reward_model"]["ground_truth"] == ("r" if red > blue else "b")  # one letter: r(ed) or b(lue)
        # what the docstring promises a tiny model: the mean red and blue channels tell the answer
        assert (rgb[..., 0].mean() > rgb[..., 2].mean()) == (red > blue)
    assert set(Counter(r["reward_model"]["ground_truth"] for r in rows)) == {"r", "b"}


def blobs(dark: np.ndarray) -> int:
    """Connected regions (4-neighbours) of a boolean mask."""
    seen, count = np.zeros_like(dark), 0
    for start in zip(*np.nonzero(dark)):
        if seen[start]:
            continue
        count, stack = count + 1, [start]
        while stack:
            y, x = stack.pop()
            if 0 <= y < dark.shape[0] and 0 <= x < dark.shape[1] and dark[y, x] and not seen[y, x]:
                seen[y, x] = True
                stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return count


def test_count_dots_answer_is_the_number_of_dots():
    rows = make_task_rows("count_dots", "train", 100, seed=0)
    for row in rows:
        assert blobs(pixels(row).sum(-1) < 200) == int(row["reward_model"]["ground_truth"])
    assert set(Counter(r["reward_model"]["ground_truth"] for r in rows)) == {"1", "2", "3", "4"}


def test_geo3k_synthetic_rows_are_verls_geo3k_rows():
    for row in make_task_rows("geo3k_synthetic", "test", 30, seed=0):
        info, answer = row["extra_info"], row["reward_model"]["ground_truth"]
        assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
        assert row["prompt"][0]["content"] == f"{info['question']} {GEO3K_INSTRUCTION}"
        assert info["answer"] == answer and float(answer) > 0
        assert default_compute_score(row["data_source"], f"<think>x</think> \\boxed{{{answer}}}", answer) == 1.0
        assert default_compute_score(row["data_source"], f"\\boxed{{{float(answer) + 1}}}", answer) == 0.0


def test_image_rows_round_trip_through_parquet(tmp_path):
    train, test = write_task_files("count_dots", tmp_path, n_train=12, n_val=4, seed=5)
    table = pq.read_table(train)
    assert table.schema.field("images").type == IMAGES_TYPE  # as the Hugging Face Image feature writes it
    assert table.to_pylist() == make_task_rows("count_dots", "train", 12, 5)
    assert pq.read_table(test).to_pylist() == make_task_rows("count_dots", "test", 4, 5)


@pytest.mark.parametrize("source, response, truth, score", [
    ("larger_shape", "r", "r", 1.0), ("larger_shape", " b.", "b", 1.0),
    ("larger_shape", "b", "r", 0.0), ("larger_shape", "R", "r", 0.0),  # lower case, as the prompt asks
    ("larger_shape", "red", "r", 0.0), ("larger_shape", "rb", "r", 0.0),  # the one letter, nothing joined to it
    ("larger_shape", "the r", "r", 0.0),                                # the answer comes first
    ("count_dots", "3", "3", 1.0), ("count_dots", "3 dots", "3", 1.0), ("count_dots", "three", "3", 0.0),
    ("count_dots", "34", "3", 0.0),
])
def test_vision_task_rewards(source, response, truth, score):
    assert default_compute_score(source, response, truth) == score
