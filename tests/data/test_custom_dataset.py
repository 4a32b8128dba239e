"""verl's data.custom_cls: a user's torch Dataset class read into rows, trained, and refused in one line.

The side-by-side test builds a subclass of verl 0.9.1's own RLHFDataset and needs verl installed aside:

    pip install --no-deps --target DIR verl==0.9.1 tensordict pyvers cloudpickle omegaconf \\
        antlr4-python3-runtime==4.9.3 datasets multiprocess pandas dill xxhash fsspec
    PLAIT_VERL_SITE=DIR pytest tests/data/test_custom_dataset.py

Without PLAIT_VERL_SITE that test skips, naming it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plait import cli
from plait.configtree import ConfigError, to_dict
from plait.data.custom_dataset import load_custom_dataset
from plait.data.tasks import make_task_rows
from plait.models import build_char_tokenizer

# A plain torch Dataset over JSONL files, as a user writes one for verl: it reads the rows itself, asks each
# question twice ("1+2= 1+2=") and tags extra_info, so its rows are not the file's.
CLASS = '''
import json
import torch
from torch.utils.data import Dataset


class Doubled(Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        self.rows = [json.loads(line) for path in data_files for line in open(path)]
        self.prompt_key = config.get("prompt_key", "prompt")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[i])
        text = row[self.prompt_key][-1]["content"]
        row["raw_prompt"] = [{"role": "user", "content": text + " " + text}]
        row["extra_info"] = {**row["extra_info"], "from": "Doubled"}
        row["tools_kwargs"] = {"calc": {"create_kwargs": {"n": i}}}
        row["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        return row
'''


def write_files(tmp_path, source: str = CLASS) -> tuple[str, str, str]:
    (tmp_path / "mine.py").write_text(source)
    paths = []
    for split, n in (("train", 16), ("test", 4)):
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make_task_rows("arithmetic", split, n, 0)))
        paths.append(str(path))
    return str(tmp_path / "mine.py"), paths[0], paths[1]


def custom_overrides(tmp_path, source: str = CLASS, name: str = "Doubled") -> list[str]:
    cls, train, val = write_files(tmp_path, source)
    return [f"data.custom_cls.path={cls}", f"data.custom_cls.name={name}", f"data.train_files={train}",
            f"data.val_files={val}"]


def test_the_class_items_become_the_rows(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path / "out", *custom_overrides(tmp_path))
    data = load_custom_dataset(cfg, "data.train_files", cfg.data.train_files, build_char_tokenizer(),
                               return_raw_chat=True)
    first = make_task_rows("arithmetic", "train", 16, 0)[0]
    text = first["prompt"][-1]["content"]
    assert len(data) == 16
    item = data[0]
    assert f"{text} {text}" in item.prompt_text  # the class's prompt, not the file's
    assert item.ground_truth == first["reward_model"]["ground_truth"] and item.data_source == "arithmetic"
    assert item.extra_info["from"] == "Doubled" and item.extra_info["tools_kwargs"] == {"calc": {"create_kwargs": {"n": 0}}}
    assert item.extra_info["raw_prompt"] == [{"role": "user", "content": f"{text} {text}"}]


def test_a_plain_dataset_class_trains_a_sync_step(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path / "out", *custom_overrides(tmp_path), "trainer.total_training_steps=1",
                      "trainer.test_freq=-1", "trainer.val_before_train=false")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    assert cli.main(["train", "--no-progress", "--config", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1]


def run_train(tmp_path, tiny_config, capsys, overrides) -> str:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(tiny_config(tmp_path / "out", *overrides))))
    assert cli.main(["train", "--no-progress", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


BAD_ITEM = CLASS.replace('row["raw_prompt"] = ', 'row["text"] = ')
TENSOR_ITEM = CLASS.replace('row["dummy_tensor"]', 'row["input_ids"]')
UNSCORED_ITEM = CLASS.replace('row["dummy_tensor"] = ', 'row["data_source"] = "my_task"; row["dummy_tensor"] = ')
VIDEO_ITEM = CLASS.replace('[{"role": "user", "content": text + " " + text}]',
                           '[{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]')


EXITS_ITEM = CLASS.replace("row = dict(self.rows[i])", "import sys; sys.exit(0)")
EXITS_BUILD = CLASS.replace("self.rows = [", "import sys; sys.exit(0); self.rows = [")
HUGE = CLASS.replace("return len(self.rows)", "return 10**9").replace("dict(self.rows[i])",
                                                                       "dict(self.rows[i % len(self.rows)])")


@pytest.mark.parametrize("source, name, key, said", [
    (EXITS_ITEM, "Doubled", "data.custom_cls.name='Doubled'", "Doubled[0] failed: SystemExit: 0"),  # was exit 0, untrained
    (EXITS_BUILD, "Doubled", "data.custom_cls.name='Doubled'", "failed: SystemExit: 0"),
    (HUGE, "Doubled", "data.custom_cls.name='Doubled'",  # grew to GiBs without a word
     "len() of Doubled is 1000000000: its first"),
    (CLASS, "Missing", "data.custom_cls.name='Missing'", "defines no class 'Missing'; its Dataset classes: Doubled"),
    (CLASS + "\nclass Plain:\n    pass\n", "Plain", "data.custom_cls.name='Plain'",
     "Plain in '{cls}' is not a torch.utils.data.Dataset subclass"),
    ("import no_such_module_here\n", "Doubled", "data.custom_cls.path='{cls}'",
     "importing it failed: no module named 'no_such_module_here'; install it beside plait"),
    ("from verl.utils.dataset import RLHFDataset\n", "Doubled", "data.custom_cls.path='{cls}'",
     "importing it failed: no module named 'verl'"),
    (CLASS.replace("self.rows = [", "raise OSError('no shard');self.rows = ["), "Doubled", "data.custom_cls.name='Doubled'",
     "building Doubled over data.train_files=['{train}'] failed: OSError: no shard"),
    (BAD_ITEM, "Doubled", "data.custom_cls.name='Doubled'", "Doubled[0] has no 'raw_prompt'"),
    (TENSOR_ITEM, "Doubled", "data.custom_cls.name='Doubled'", "Doubled[0]['input_ids'] holds precomputed model inputs"),
    (VIDEO_ITEM, "Doubled", "data.custom_cls.name='Doubled'", "Doubled[0]['raw_prompt'] has a 'video' content part"),
    (UNSCORED_ITEM, "Doubled", "data.train_files=\"Doubled's items\"",  # checked at start, as data files are
     "data_source 'my_task' (row 0) has no built-in reward"),
])
def test_a_bad_dataset_class_is_one_line_exit_2(tmp_path, tiny_config, capsys, source, name, key, said):
    if "no module named 'verl'" in said and importlib_finds("verl"):
        pytest.skip("verl is importable here")
    overrides = custom_overrides(tmp_path, source, name)
    cls, train = str(tmp_path / "mine.py"), str(tmp_path / "train.jsonl")
    line = run_train(tmp_path, tiny_config, capsys, overrides)
    assert line.startswith(f"plait: config error: {key.format(cls=cls)}: "), line
    assert said.format(cls=cls, train=train) in line, line


def test_a_missing_class_file_is_one_line(tmp_path, tiny_config, capsys):
    overrides = custom_overrides(tmp_path)
    overrides[0] = f"data.custom_cls.path={tmp_path / 'nowhere.py'}"
    line = run_train(tmp_path, tiny_config, capsys, overrides)
    assert line.startswith(f"plait: config error: data.custom_cls.path='{tmp_path / 'nowhere.py'}': no such file")


def test_a_path_without_a_name_is_refused():
    from plait.config import load_config
    with pytest.raises(ConfigError, match="data.custom_cls.name=None: the dataset class's name when path is set"):
        load_config(None, ["data.custom_cls.path=mine.py"])


def importlib_finds(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


VERL_SITE = os.environ.get("PLAIT_VERL_SITE")
# verl's RLHFDataset and a subclass of it (what verl-recipe's classes are), each read by verl and by plait.
SIDE = '''
import json, sys
from plait.config import load_config
from plait.data.custom_dataset import load_custom_dataset
from plait.models import build_char_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from omegaconf import OmegaConf

cls_path, train = sys.argv[1], sys.argv[2]
cfg = load_config(None, [f"data.custom_cls.path={cls_path}", "data.custom_cls.name=Tagged", f"data.train_files={train}",
                         "data.max_prompt_length=64", "actor_rollout_ref.model.path=x"])
tok = build_char_tokenizer()
plait_rows = load_custom_dataset(cfg, "data.train_files", [train], tok, return_raw_chat=True)
import importlib.util
spec = importlib.util.spec_from_file_location("tagged", cls_path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
conf = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 64, "filter_overlong_prompts": False,
                         "return_raw_chat": True, "cache_dir": sys.argv[3]})
verl = mod.Tagged(data_files=[train], tokenizer=tok, config=conf, processor=None, max_samples=-1)
out = []
for i, item in enumerate(plait_rows.items):
    v = verl[i]
    out.append({"same_prompt": item.extra_info["raw_prompt"] == v["raw_prompt"],
                "same_text": item.prompt_text == tok.apply_chat_template(v["raw_prompt"], add_generation_prompt=True,
                                                                          tokenize=False),
                "same_source": item.data_source == v["data_source"],
                "same_truth": item.ground_truth == v["reward_model"]["ground_truth"],
                "same_extra": {k: x for k, x in item.extra_info.items() if k != "raw_prompt"} == v["extra_info"],
                "tag": item.extra_info.get("tag")})
print(json.dumps({"n": (len(plait_rows), len(verl)), "rows": out}))
'''


@pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl").is_dir(),
                    reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")
def test_a_subclass_of_verls_rlhf_dataset_gives_verls_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = make_task_rows("arithmetic", "train", 12, 0)
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    (tmp_path / "tagged.py").write_text(
        "from verl.utils.dataset.rl_dataset import RLHFDataset\n\n\nclass Tagged(RLHFDataset):\n"
        "    def __getitem__(self, item):\n        row = super().__getitem__(item)\n"
        "        row['extra_info'] = {**row['extra_info'], 'tag': 'tagged'}\n        return row\n")
    path = os.pathsep.join([str(Path(__file__).parents[2]), VERL_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "VERL_LOGGING_LEVEL": "ERROR", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", SIDE, str(tmp_path / "tagged.py"), str(train), str(tmp_path / "cache")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n"] == [12, 12]
    for row in result["rows"]:
        assert row == {"same_prompt": True, "same_text": True, "same_source": True, "same_truth": True,
                       "same_extra": True, "tag": "tagged"}


def test_image_parts_become_placeholders_and_images_and_a_text_model_refuses_them(tmp_path, tiny_config):
    from PIL import Image

    from plait.data.custom_dataset import verl_row
    image = Image.new("RGB", (28, 28), "red")
    item = {"raw_prompt": [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                                        {"type": "image", "image": image},
                                                        {"type": "text", "text": "?"}]}],
            "data_source": "arithmetic", "reward_model": {"ground_truth": "1"}, "extra_info": {}}
    row = verl_row("Pics", 0, item, "prompt", "data_source", "images")
    assert row["prompt"] == [{"role": "user", "content": "What is <image>?"}] and row["images"] == [image]
    source = CLASS.replace('[{"role": "user", "content": text + " " + text}]',
                           '[{"role": "user", "content": [{"type": "image", "image": {"path": "x.png"}}]}]')
    cfg = tiny_config(tmp_path / "out", *custom_overrides(tmp_path, source))
    with pytest.raises(ConfigError, match=r"Doubled's items over data.train_files: row 0: column 'images' "
                                          r"\(data.image_key\) holds list media, which needs a vision-language model"):
        load_custom_dataset(cfg, "data.train_files", cfg.data.train_files, build_char_tokenizer(),
                            media_keys={"data.image_key": "images"})
