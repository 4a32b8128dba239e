"""Bad data and bad model dirs are config errors (exit 2): one line naming the file, the line or
row, and what was expected — raised before any training work."""

import json
import shutil

import pytest
from transformers import BertConfig, BertForMaskedLM

from plait.configtree import ConfigError
from plait.data.dataset import load_dataset
from plait.data.tasks import make_task_rows
from plait.models import build_char_tokenizer, check_model_dir, create_tiny_model

ROWS = make_task_rows("arithmetic", "train", 3, 0)
KEY = "actor_rollout_ref.model.path"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def jsonl(tmp_path, *lines, name="rows.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def load(path, tok, **options):
    return load_dataset("data.train_files", [path], tok, **options)


def row(**change):
    return json.dumps({**ROWS[0], **change}).encode()


@pytest.mark.parametrize("lines, said", [
    ((row(), b'{"data_source": "arithmetic", "prompt": [', row()), "line 2 is not valid JSON"),
    ((row(), row(), b'\xff\xfe' + row()), "line 3 is not UTF-8 text (byte 0xff)"),
    ((row(), b"[1, 2]"), "line 2 is a JSON list, expected an object"),
    ((), "the file holds no rows"),
    ((row(), json.dumps({"prompt": "x"}).encode()), "row 1 has no 'data_source', 'reward_model'"),
    ((row(reward_model={"style": "rule", "ground_truth": None}),), "row 0: reward_model.ground_truth is missing or null"),
])
def test_a_bad_jsonl_file_names_itself_and_the_line_or_row(tmp_path, tok, lines, said):
    path = jsonl(tmp_path, *lines)
    with pytest.raises(ConfigError) as err:
        load(path, tok)
    assert str(err.value).startswith(f"data.train_files={path!r}: ") and said in str(err.value)


def parquet(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("content, said", [
    (b"\xff\xfe 1+1=", "row 0: 'prompt' holds bytes that are not UTF-8 (byte 0xff at offset 0)"),
    (b"1+1=", "row 0: 'prompt' holds bytes, not a string (b'1+1=')"),  # a chat template would write "b'1+1='"
])
def test_a_prompt_of_bytes_is_refused_naming_file_and_row(tmp_path, tok, content, said):
    """A binary parquet column gives bytes, which a chat template renders as their repr
    (`user b'\\xff...' assistant`): refused in one line, whatever the bytes."""
    import pyarrow as pa
    message = pa.struct([("role", pa.string()), ("content", pa.binary())])  # a binary column
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)),
                        ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": text}],
             "reward_model": {"ground_truth": "2"}} for text in (content, b"2+2=")]
    path = str(tmp_path / "rows.parquet")
    pa.parquet.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    with pytest.raises(ConfigError) as err:
        load(path, tok)
    assert str(err.value) == f"data.train_files={path!r}: {said}; text fields are UTF-8 strings"
    plain = parquet(tmp_path, [{**ROWS[0], "prompt": content}])  # a bytes prompt, no chat
    with pytest.raises(ConfigError, match=f"{plain}.*row 0: 'prompt' holds bytes"):
        load(plain, tok)


def test_a_prompt_that_is_not_valid_unicode_is_refused(tmp_path, tok):
    path = jsonl(tmp_path, row(), row(prompt=[{"role": "user", "content": "1+\ud800="}]))  # a JSON escape: lone surrogate
    with pytest.raises(ConfigError) as err:
        load(path, tok)
    assert str(err.value) == (f"data.train_files={path!r}: row 1: 'prompt' holds a string that is not valid Unicode "
                              "(code point 0xd800 at offset 2); text fields are UTF-8 strings")
    gt = parquet(tmp_path, [{**ROWS[0], "reward_model": {"ground_truth": b"\xff42"}}])  # scored as "b'\\xff42'"
    with pytest.raises(ConfigError, match=r"row 0: reward_model.ground_truth holds bytes that are not UTF-8"):
        load(gt, tok)


def test_an_unreadable_parquet_file_is_named(tmp_path, tok):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=r"rows\.parquet.*not a readable parquet file"):
        load(str(path), tok)


def test_too_long_prompt_suggests_values_the_config_accepts(tmp_path, tok):
    from plait.config import load_config
    path = jsonl(tmp_path, row())
    with pytest.raises(ConfigError) as err:
        load(path, tok, max_prompt_length=2)
    message = str(err.value)
    assert "set data.max_prompt_length=" in message and "or data.truncation=left" in message
    fixes = [message.split("set ")[1].split(" or ")[0], "data.truncation=left"]
    for fix in fixes:
        load_config(None, [fix])  # each suggestion is a value the config accepts
    assert len(load(path, tok, max_prompt_length=int(fixes[0].split("=")[1]))) == 1


def test_rows_of_several_files_are_numbered_on(tmp_path, tok):
    a = jsonl(tmp_path, row(extra_info={}), name="a.jsonl")
    b = jsonl(tmp_path, row(extra_info={}), row(extra_info={}), name="b.jsonl")
    assert [it.index for it in load_dataset("data.train_files", [a, b], tok)] == [0, 1, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="xs")


def broken(tmp_path, model_dir, damage):
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    if damage == "empty":
        shutil.rmtree(path)
        path.mkdir()
    elif damage == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).unlink()
    elif damage == "corrupt_config":
        (path / "config.json").write_text('{"model_type": "qwen2", "hidden')
    elif damage == "no_weights":
        (path / "model.safetensors").unlink()
    elif damage == "masked_lm":
        shutil.rmtree(path)
        BertForMaskedLM(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=8)).save_pretrained(path)
        shutil.copy(f"{model_dir}/tokenizer.json", path)
    return str(path)


@pytest.mark.parametrize("damage, said", [
    ("empty", "no config.json: not a Hugging Face model directory"),
    ("no_tokenizer", "no tokenizer (none of tokenizer.json"),
    ("corrupt_config", "config.json is unreadable (JSONDecodeError"),
    ("no_weights", "no weights (*.safetensors or *.bin)"),
    ("masked_lm", "a BertForMaskedLM model is not a causal language model"),
])
def test_a_broken_model_dir_is_one_named_config_error(tmp_path, model_dir, damage, said):
    path = broken(tmp_path, model_dir, damage)
    with pytest.raises(ConfigError) as err:
        check_model_dir(KEY, path)
    assert str(err.value).startswith(f"{KEY}={path!r}: ") and said in str(err.value)
    assert "\n" not in str(err.value)


def test_an_intact_model_dir_passes(model_dir):
    check_model_dir(KEY, model_dir)


def test_the_cli_reports_a_broken_model_in_one_line_with_exit_2(tmp_path, model_dir, capsys):
    from plait import cli
    path = broken(tmp_path, model_dir, "corrupt_config")
    assert cli.main(["train", f"actor_rollout_ref.model.path={path}", f"trainer.default_local_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"plait: config error: {KEY}=") and len([l for l in err if "Traceback" in l]) == 0


def test_config_show_refuses_what_train_refuses(tmp_path, model_dir, capsys):
    from plait import cli
    path = broken(tmp_path, model_dir, "no_weights")
    for command in ("train", "config show"):
        assert cli.main([*command.split(), f"actor_rollout_ref.model.path={path}",
                         f"trainer.default_local_dir={tmp_path / 'out'}"]) == 2
        assert "no weights" in capsys.readouterr().err.strip().splitlines()[-1]
