"""verl 0.9.1's on-policy distillation scripts (examples/on_policy_distillation_trainer/*_fsdp.sh) run with
`plait train`: the arguments each passes, recorded in tests/fixtures/verl_scripts/distillation/ with the models
(tiny ones built here: a student and teachers sharing its tokenizer), the data and the engine swapped for what
runs on this CPU, as tests/fixtures/verl_scripts does for verl's other scripts. Each trains two steps in sync
mode; the text one also in fully_async mode, and on Ray with the teachers on a pool of their own
(distillation.nnodes x n_gpus_per_node worker processes) and beside the actor (distillation.nnodes=0).
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SCRIPTS = Path(__file__).parent.parent / "fixtures" / "verl_scripts" / "distillation"
NAMES = ("run_qwen3_8b_fsdp", "run_qwen3_8b_mopd_fsdp", "run_qwen3_vl_8b_fsdp", "run_qwen3_5_4b_fsdp")


def script_args(name: str, paths: dict[str, str]) -> list[str]:
    """The command line of a recorded script after `plait train`, with $VARS filled in."""
    text = "\n".join(line for line in (SCRIPTS / f"{name}.sh").read_text().splitlines() if not line.startswith("#"))
    argv = shlex.split(re.sub(r"\$(\w+)", lambda m: paths[m.group(1)], text.replace("\\\n", " ")))
    assert argv[:2] == ["plait", "train"]
    return argv[2:]


def with_source(path: str, source: str, out: Path) -> str:
    """The rows of `path` under another data_source (verl's gsm8k preprocessing names its rows openai/gsm8k)."""
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("data_source"), "data_source", pa.array([source] * table.num_rows))
    pq.write_table(table, out)
    return str(out)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from plait.data.tasks import write_task_files
    from plait.models import create_tiny_model, create_tiny_vl_model
    root = tmp_path_factory.mktemp("opd")
    train, test = write_task_files("arithmetic", root / "arith", 16, 4)
    math_train, math_test = write_task_files("arithmetic", root / "math", 16, 4, seed=1)
    geo_train, geo_test = write_task_files("geo3k_synthetic", root / "geo", 16, 4)
    return {"MODEL_PATH": create_tiny_model(root / "student", size="xs", seed=0),
            "TEACHER_PATH": create_tiny_model(root / "teacher", size="xs", seed=1),
            "TRAIN_FILE": train, "TEST_FILE": test, "TRAIN_FILE_B": math_train, "TEST_FILE_B": math_test,
            "VL_MODEL_PATH": create_tiny_vl_model(root / "vl_student", seed=0),
            "VL_TEACHER_PATH": create_tiny_vl_model(root / "vl_teacher", seed=1),
            "VL_TEACHER2_PATH": create_tiny_vl_model(root / "vl_teacher2", seed=2),
            "GSM8K_TRAIN_FILE": with_source(train, "openai/gsm8k", root / "gsm8k_train.parquet"),
            "GSM8K_TEST_FILE": with_source(test, "openai/gsm8k", root / "gsm8k_test.parquet"),
            "GEO3K_TRAIN_FILE": geo_train, "GEO3K_TEST_FILE": geo_test}


def train(name: str, paths: dict, out: Path, *extra: str) -> list[dict]:
    """Two steps of the recorded script with `extra` appended (as verl's scripts pass "$@" on); the metrics."""
    args = [*script_args(name, paths), "trainer.total_training_steps=2", "trainer.logger=console",
            f"trainer.default_local_dir={out}", *extra]
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--no-progress", *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["timing_s/teacher"] > 0 for r in rows)
    return rows


def test_there_are_verls_four_fsdp_scripts():
    assert sorted(p.stem for p in SCRIPTS.glob("*.sh")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_script_trains_two_steps(name, paths, tmp_path):
    rows = train(name, paths, tmp_path)
    # k1 as a policy gradient without task rewards: the loss is the distillation loss alone, under verl's names
    for key in ("actor/distillation/loss", "actor/distillation/abs_loss", "actor/distillation/loss_min",
                "actor/distillation/loss_max", "actor/distillation/pg_clipfrac", "actor/distillation/ppo_kl"):
        assert key in rows[-1], key
    assert rows[-1]["actor/distillation/abs_loss"] > 0  # a teacher of other weights scores differently


def test_the_text_script_trains_fully_async(paths, tmp_path):
    rows = train("run_qwen3_8b_fsdp", paths, tmp_path, "trainer.mode=fully_async", "trainer.placement=separated")
    assert rows[-1]["actor/distillation/abs_loss"] > 0


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["fully_async"])  # sync with a teacher pool on Ray: the multi-teacher test below
def test_the_text_script_trains_on_ray_with_a_teacher_pool(paths, tmp_path, mode):
    # the script's teacher pool of 4 devices: 2 CPU worker processes here (the pool's size must match the
    # replica x tensor-parallel sizes, verl's rule: one replica of 2), beside 1 actor worker
    extra = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.num_cpus=4", "distillation.n_gpus_per_node=2"]
    if mode == "fully_async":
        extra += ["trainer.mode=fully_async", "trainer.placement=separated"]
    rows = train("run_qwen3_8b_fsdp", paths, tmp_path, *extra)
    assert rows[-1]["actor/distillation/abs_loss"] > 0


@pytest.mark.ray
def test_the_multi_teacher_script_trains_on_ray_beside_the_actor(paths, tmp_path):
    rows = train("run_qwen3_8b_mopd_fsdp", paths, tmp_path, "trainer.backend=ray", "trainer.ray.num_cpu_workers=2",
                 "distillation.nnodes=0")  # the teachers on the actor's two workers, each scoring its share of rows
    assert rows[-1]["actor/distillation/abs_loss"] > 0
