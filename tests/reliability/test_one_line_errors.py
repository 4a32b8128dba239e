"""Bad input found before training is one line and exit 2: a reward file that does not import,
a model whose vocabulary is smaller than its tokenizer, a batch larger than the data, malformed
chat messages (named by file and row). No traceback."""

import json

import pytest
import yaml

from plait import cli
from plait.configtree import ConfigError, to_dict
from plait.data.dataset import load_dataset
from plait.data.tasks import make_task_rows
from plait.models import build_char_tokenizer, create_tiny_model


def train(tmp_path, tiny_config, *overrides) -> tuple[int, list[str]]:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(tiny_config(tmp_path / "out", *overrides))))
    return cli.main(["train", "--no-progress", "--config", str(config)])


def last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("source, said", [
    ("def compute_score(data_source, solution_str\n    return 1\n", "importing it failed: SyntaxError: "),
    ("import no_such_module_here\n", "importing it failed: no module named 'no_such_module_here'"),
    ("raise RuntimeError('boom')\ndef compute_score(**kw):\n    return 1\n", "importing it failed: RuntimeError: boom"),
])
def test_a_reward_file_that_does_not_import_is_one_line_exit_2(tmp_path, tiny_config, capsys, source, said):
    (tmp_path / "reward.py").write_text(source)
    assert train(tmp_path, tiny_config, f"custom_reward_function.path={tmp_path / 'reward.py'}") == 2
    line = last_line(capsys)
    assert line.startswith(f"plait: config error: reward.custom_reward_function.path='{tmp_path / 'reward.py'}': ")
    assert said in line


def test_a_vocabulary_smaller_than_the_tokenizer_is_one_line_exit_2(tmp_path, tiny_config, capsys):
    model = create_tiny_model(tmp_path / "model", size="xs")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["vocab_size"] = 8
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert train(tmp_path, tiny_config, f"actor_rollout_ref.model.path={model}") == 2
    line = last_line(capsys)
    assert line.startswith(f"plait: config error: actor_rollout_ref.model.path='{model}': the model's vocabulary "
                           "has 8 tokens but its tokenizer has ")


def test_a_batch_larger_than_the_data_is_one_line_exit_2_before_any_step(tmp_path, tiny_config, capsys):
    assert train(tmp_path, tiny_config, "data.train_size=6", "data.train_batch_size=8") == 2
    line = last_line(capsys)
    assert line.startswith("plait: config error: data.train_batch_size=8: larger than the training set (6 prompts in ")
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not (tmp_path / "out" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("prompt, said", [
    ([{"role": "user"}], "row 1: 'prompt' message 0 has no 'content': {'role': 'user'}"),
    ([{"content": "hi"}], "row 1: 'prompt' message 0 has no 'role'"),
    ([{"role": "user", "content": "hi"}, "hello"], "row 1: 'prompt' message 1 has no 'role' or 'content': 'hello'"),
    ([], "row 1: 'prompt' is []; expected a string or a non-empty list of chat messages"),
    (7, "row 1: 'prompt' is 7; expected a string"),
])
def test_a_malformed_chat_row_names_the_file_and_row(tmp_path, prompt, said):
    rows = make_task_rows("arithmetic", "train", 2, 0)
    rows[1]["prompt"] = prompt
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as err:
        load_dataset("data.train_files", [str(path)], build_char_tokenizer())
    assert str(err.value).startswith(f"data.train_files={str(path)!r}: {said}")
    assert "\n" not in str(err.value)


def test_data_sources_without_a_reward_are_one_line_each_before_any_model_loads(tmp_path, tiny_config, capsys):
    """No reward file and no reward model: every row's data_source in the train and val files needs
    a built-in reward, checked at start (it was a traceback at the first reward, the model loaded)."""
    from plait import driver
    rows = make_task_rows("arithmetic", "train", 6, 0)
    rows[2] = {**rows[2], "data_source": "my_task"}
    rows[4] = {**rows[4], "data_source": "my_task"}
    rows[5] = {**rows[5], "data_source": 7}
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val_file.write_text(json.dumps({**rows[0], "data_source": "val_only"}) + "\n")
    files = [f"data.train_files={train_file}", f"data.val_files={val_file}"]
    with pytest.raises(ConfigError) as err:
        driver.preflight(tiny_config(tmp_path / "out", *files))  # the CLI's check before the trainer is built
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"data.train_files='{train_file}': data_source 'my_task' (row 2), 7 (row 5) have no "
                               "built-in reward (built-in: arithmetic, reverse, ")
    assert lines[0].endswith("aime*; with reward.sandbox_fusion.url: codecontests, apps, codeforces, taco) and "
                             "reward.custom_reward_function.path is unset: give a reward file that scores it")
    assert lines[1].startswith(f"data.val_files='{val_file}': data_source 'val_only' (row 0) has no built-in reward")
    assert train(tmp_path, tiny_config, *files) == 2
    assert "Traceback" not in capsys.readouterr().err
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 0.0\n")
    driver.preflight(tiny_config(tmp_path / "out", *files, f"custom_reward_function.path={tmp_path / 'reward.py'}"))


def test_a_non_string_ground_truth_for_the_dapo_scorer_is_one_line_at_start(tmp_path, tiny_config, capsys):
    """DAPO / aime* / math score the ground truth as text and raise on another type, as verl's do:
    caught at start, naming file, row, data source and type (it was an error at the first reward)."""
    from plait import driver
    rows = make_task_rows("arithmetic", "train", 4, 0)
    rows[1] = {**rows[1], "data_source": "math_dapo", "reward_model": {"ground_truth": "42"}}  # a string: fine
    rows[3] = {**rows[3], "data_source": "aime2024", "reward_model": {"ground_truth": 42}}
    val = {**rows[0], "data_source": "math", "reward_model": {"ground_truth": [1, 2]}}
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val_file.write_text(json.dumps(val) + "\n")
    files = [f"data.train_files={train_file}", f"data.val_files={val_file}"]
    with pytest.raises(ConfigError) as err:
        driver.preflight(tiny_config(tmp_path / "out", *files))
    assert str(err.value).splitlines() == [
        f"data.train_files='{train_file}': row 3: data_source 'aime2024' is scored by the DAPO/AIME/math scorer, "
        "which needs a string reward_model.ground_truth; this one is a int (42): store it as a string",
        f"data.val_files='{val_file}': row 0: data_source 'math' is scored by the DAPO/AIME/math scorer, "
        "which needs a string reward_model.ground_truth; this one is a list ([1, 2]): store it as a string"]
    assert train(tmp_path, tiny_config, *files) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("plait: config error") == 2
    rows[3]["data_source"] = "openai/gsm8k"  # GSM8K's scorer: a non-string never matches (as verl's), no error
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    driver.preflight(tiny_config(tmp_path / "out", f"data.train_files={train_file}"))


def test_the_batch_manager_without_a_reward_file_is_one_line(capsys):
    assert cli.main(["config", "show", "reward.reward_manager.name=batch"]) == 2
    assert last_line(capsys) == ("plait: config error: reward.reward_manager.name='batch': a reward file to go with it "
                                 "(reward.custom_reward_function.path): the batch manager calls one function with "
                                 "lists, and the built-in scorer takes one response at a time")
