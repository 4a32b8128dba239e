import json

import pytest

from plait.configtree import ConfigError
from plait.data.dataset import PromptDataset, iterate_batches, load_rows, truncate
from plait.data.tasks import make_task_rows, write_task_files
from plait.models import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_parquet_and_jsonl_load_the_same_rows(tmp_path):
    train_path, val_path = write_task_files("arithmetic", tmp_path, n_train=12, n_val=4, seed=0)
    rows = make_task_rows("arithmetic", "train", 12, 0)
    assert load_rows(train_path) == rows
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_rows(jsonl) == rows
    both = load_rows([train_path, val_path])
    assert both[:12] == rows and both[12:] == make_task_rows("arithmetic", "test", 4, 0)


def test_load_rows_errors_name_the_file(tmp_path):
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"rows\.csv.*\.parquet, \.jsonl"):
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        load_rows(str(tmp_path / "missing.parquet"))


def test_items_carry_template_ids_and_reward_fields(tok):
    rows = make_task_rows("arithmetic", "test", 3, 0)
    rows.append({"data_source": "reverse", "prompt": "rev abc=",
                 "reward_model": {"ground_truth": "cba"}})  # a plain-string prompt
    ds = PromptDataset(rows, tok, max_prompt_length=16)
    assert len(ds) == 4
    first = ds[0]
    assert first.prompt_text == rows[0]["prompt"][0]["content"] + "\n"
    assert tok.decode(first.prompt_ids) == first.prompt_text
    assert first.data_source == "arithmetic"
    assert first.ground_truth == rows[0]["reward_model"]["ground_truth"]
    assert first.extra_info == {"split": "test", "index": 0} and ds[2].index == 2
    assert ds[3].prompt_text == "rev abc=" and tok.decode(ds[3].prompt_ids) == "rev abc="
    assert ds[3].index == 3 and ds[3].extra_info == {}


def test_over_long_prompt_errors_or_truncates(tok):
    rows = [{"data_source": "reverse", "prompt": [{"role": "user", "content": "rev abcdef="}],
             "reward_model": {"ground_truth": "fedcba"}}]
    with pytest.raises(ValueError, match="row 0: prompt is 12 tokens.*max_prompt_length=5"):
        PromptDataset(rows, tok, max_prompt_length=5)
    left = PromptDataset(rows, tok, max_prompt_length=5, truncation="left")[0]
    right = PromptDataset(rows, tok, max_prompt_length=5, truncation="right")[0]
    assert tok.decode(left.prompt_ids) == "def=\n" and tok.decode(right.prompt_ids) == "rev a"
    middle = PromptDataset(rows, tok, max_prompt_length=5, truncation="middle")[0]
    assert tok.decode(middle.prompt_ids) == "ref=\n"  # the 2 first and 3 last tokens
    with pytest.raises(ConfigError, match="truncation='center'"):
        PromptDataset(rows, tok, truncation="center")
    with pytest.raises(KeyError, match="row 0 has no 'reward_model'"):
        PromptDataset([{"data_source": "x", "prompt": "hi"}], tok)


def test_batches_are_seeded_full_and_cover_each_item_once(tok):
    ds = PromptDataset(make_task_rows("arithmetic", "train", 10, 0), tok)
    epoch0 = [[item.index for item in batch] for batch in iterate_batches(ds, 3, True, 7, 0)]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)  # the 10th item is dropped
    assert len({i for b in epoch0 for i in b}) == 9
    assert epoch0 == [[it.index for it in b] for b in iterate_batches(ds, 3, True, 7, 0)]
    assert epoch0 != [[it.index for it in b] for b in iterate_batches(ds, 3, True, 7, 1)]
    assert epoch0 != [[it.index for it in b] for b in iterate_batches(ds, 3, True, 8, 0)]
    ordered = [[it.index for it in b] for b in iterate_batches(ds, 4, shuffle=False)]
    assert ordered == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="10 prompts make no full batch of 11"):
        next(iterate_batches(ds, 11))


def test_truncate_by_hand():
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 4, "middle") == [0, 1, 8, 9]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]


def test_filter_overlong_prompts_drops_and_counts(tok):
    rows = [{"data_source": "reverse", "prompt": [{"role": "user", "content": c}],
             "reward_model": {"ground_truth": ["a", "b"]}} for c in ("ab", "abcdefgh", "abc", "abcdefghij")]
    ds = PromptDataset(rows, tok, max_prompt_length=4, filter_overlong_prompts=True)
    assert ds.filtered == 2 and [it.index for it in ds] == [0, 2]
    assert ds[0].ground_truth == ["a", "b"]  # as stored, not a string
    assert PromptDataset(rows, tok, max_prompt_length=20, filter_overlong_prompts=True).filtered == 0


def test_return_raw_chat_keeps_the_messages_in_extra_info(tok):
    rows = make_task_rows("arithmetic", "test", 2, 0)
    raw = PromptDataset(rows, tok, return_raw_chat=True)
    assert raw[0].extra_info == {"split": "test", "index": 0, "raw_prompt": rows[0]["prompt"]}
    assert "raw_prompt" not in PromptDataset(rows, tok)[0].extra_info


def test_reward_fn_key_names_the_data_source_column(tok):
    rows = [{"source": "reverse", "prompt": "rev ab=", "reward_model": {"ground_truth": "ba"}}]
    assert PromptDataset(rows, tok, reward_fn_key="source")[0].data_source == "reverse"
    with pytest.raises(KeyError, match="row 0 has no 'data_source'"):
        PromptDataset(rows, tok)
