import io

import pyarrow.parquet as pq
import pytest
from PIL import Image

from plait.data.tasks import (MAX_OPERAND, TASKS, TEST_SHARE, make_task_rows, split_of,
                              write_task_files)
from plait.data.vision_tasks import identity


def question(row: dict) -> str:
    """The user turn (the _tools variant has a system line first), with the pixels of the row's images."""
    images = [Image.open(io.BytesIO(image["bytes"])).convert("RGB") for image in row.get("images", [])]
    return identity(row["prompt"][-1]["content"], images)


@pytest.mark.parametrize("task", ["arithmetic", "reverse"])  # gsm8k_synthetic: test_word_problems.py; its _tools variant: test_smollm2_tools_preset.py
def test_rows_have_verl_format_and_correct_answers(task):
    rows = make_task_rows(task, "train", 50, seed=0)
    assert len(rows) == 50
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == task
        assert row["prompt"] == [{"role": "user", "content": question(row)}]
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"] == {"split": "train", "index": i}
        answer = row["reward_model"]["ground_truth"]
        if task == "arithmetic":
            a, b = question(row).removesuffix("=").split("+")
            assert 0 <= int(a) <= MAX_OPERAND and answer == str(int(a) + int(b))
        else:
            word = question(row).removeprefix("rev ").removesuffix("=")
            assert word.isalpha() and word.islower() and answer == word[::-1]
        assert len(question(row)) <= 12  # short: the built-in model reads characters


@pytest.mark.parametrize("task", list(TASKS))
def test_splits_are_disjoint_and_seeded(task):
    train = make_task_rows(task, "train", 300, seed=0)
    test = make_task_rows(task, "test", 30, seed=1)
    train_q, test_q = {question(r) for r in train}, {question(r) for r in test}
    assert len(train_q) == 300 and len(test_q) == 30  # no repeats within a split
    assert not train_q & test_q
    assert {split_of(q) for q in train_q} == {"train"} and {split_of(q) for q in test_q} == {"test"}
    assert make_task_rows(task, "train", 300, seed=0) == train
    assert [question(r) for r in make_task_rows(task, "train", 300, seed=2)] != \
        [question(r) for r in train]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown task 'sort'.*arithmetic, reverse"):
        make_task_rows("sort", "train", 1, 0)
    with pytest.raises(ValueError, match="unknown split 'val'.*train, test"):
        make_task_rows("arithmetic", "val", 1, 0)
    too_many = 2 * (MAX_OPERAND + 1) ** 2 // TEST_SHARE
    with pytest.raises(ValueError, match="too few distinct test questions"):
        make_task_rows("arithmetic", "test", too_many, 0)


def test_write_task_files_round_trips_through_parquet(tmp_path):
    train_path, val_path = write_task_files("reverse", tmp_path / "data", n_train=20, n_val=5,
                                            seed=3)
    assert train_path.endswith("reverse_train.parquet")
    assert val_path.endswith("reverse_test.parquet")
    assert pq.read_table(train_path).to_pylist() == make_task_rows("reverse", "train", 20, 3)
    assert pq.read_table(val_path).to_pylist() == make_task_rows("reverse", "test", 5, 3)
