"""On-policy distillation end to end on tiny real models: verl 0.9.1's distillation.* keys with its defaults and
its checks (each a one-line config error naming the key), the student moving toward its teacher, the teacher a
role of its own (a stage in the timeline, its own profiler artifact, a lane in the report), and the start-time
refusals of a teacher whose vocabulary is not the student's or of rows no teacher is routed to."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from plait import driver
from plait.config import load_config
from plait.configtree import ConfigError
from plait.models import create_tiny_model
from plait.trainers.lifecycle import read_metrics

KEYS = Path(__file__).parent.parent / "fixtures" / "verl091_ppo_trainer_keys.txt"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    return create_tiny_model(tmp_path_factory.mktemp("teacher") / "t", size="xs", seed=7)


def on(teacher: str, *more: str) -> list[str]:
    return ["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}", *more]


def test_the_defaults_are_verls():
    cfg = load_config(None, [])
    verl = dict(line.split("=", 1) for line in KEYS.read_text().splitlines() if line.startswith("distillation."))
    loss = cfg.distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.use_policy_gradient) == ("k3", 32, True, False)
    assert (loss.loss_max_clamp, loss.log_prob_min_clamp, loss.policy_loss_mode) == (None, None, "vanilla")
    assert verl["distillation.distillation_loss.topk"] == "32" and verl["distillation.distillation_loss.loss_max_clamp"] == "null"
    assert cfg.distillation.teacher_key == verl["distillation.teacher_key"] == "data_source"
    inference = cfg.distillation.teacher_models["teacher_model"].inference
    assert inference.tensor_model_parallel_size == 2 and inference.max_num_batched_tokens == 8192
    assert (inference.prompt_length, inference.response_length) == (cfg.data.max_prompt_length, cfg.data.max_response_length)


@pytest.mark.parametrize("overrides, key, words", [
    (["distillation.distillation_loss.loss_mode=k1"], "distillation.distillation_loss.loss_mode",
     "k1's gradient does not depend"),
    (["distillation.distillation_loss.loss_mode=jsd"], "distillation.distillation_loss.loss_mode", "one of forward_kl_topk"),
    (["distillation.distillation_loss.use_policy_gradient=true", "distillation.distillation_loss.policy_loss_mode=gspo"],
     "distillation.distillation_loss.policy_loss_mode", "only PPO's vanilla"),
    (["+distillation.teacher_models.math.key=m", "+distillation.teacher_models.math.model_path=/m"],
     "distillation.teacher_models.teacher_model.model_path", "verl silently drops the default entry"),
    (["~distillation.teacher_models.teacher_model", "+distillation.teacher_models.a.key=k", "+distillation.teacher_models.a.model_path=/a",
      "+distillation.teacher_models.b.key=k", "+distillation.teacher_models.b.model_path=/b"],
     "distillation.teacher_models.b.key", "unique"),
    (["~distillation.teacher_models.teacher_model", "+distillation.teacher_models.a.model_path=/a"],
     "distillation.teacher_models.a.key", "the data_source value whose rows this teacher scores"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=3"], "distillation.n_gpus_per_node",
     "a multiple of the teacher's per-replica size 2"),
    (["~distillation.teacher_models.teacher_model", "distillation.nnodes=1", "distillation.n_gpus_per_node=4",
      "+distillation.teacher_models.a.key=a", "+distillation.teacher_models.a.model_path=/a",
      "+distillation.teacher_models.a.num_replicas=1"], "distillation.nnodes x n_gpus_per_node", "must equal"),
    (["distillation.teacher_models.teacher_model.inference.max_model_len=40"],
     "distillation.teacher_models.teacher_model.inference.max_model_len", ">= 41"),
    (["trainer.mode=diffusion"], "distillation.enabled", "on-policy distillation trains language models"),
])
def test_verls_checks_are_one_line_errors_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, on("/t", *overrides))
    first = str(info.value).splitlines()[0]  # (a duplicate key's entry, dropped, then lacks one: a second line)
    assert info.value.key == key and words in first


def read(path: Path) -> list[dict]:
    return read_metrics(str(path / "metrics.jsonl"))


def test_the_student_moves_toward_its_teacher(tmp_path, tiny_config, teacher):
    # the top-k forward KL alone, backpropagated (no task reward): the student's KL to its teacher falls
    cfg = tiny_config(tmp_path, *on(teacher, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                    "distillation.distillation_loss.topk=8", "distillation.distillation_loss.use_task_rewards=false",
                                    "actor_rollout_ref.actor.optim.lr=3e-3", "trainer.total_training_steps=8",
                                    "trainer.test_freq=-1", "trainer.save_freq=-1"))
    driver.build(cfg, progress=False).run()
    rows = read(tmp_path)
    first, last = rows[0]["actor/distillation/loss"], rows[-1]["actor/distillation/loss"]
    assert last < 0.5 * first, (first, last)
    assert rows[-1]["actor/distillation/teacher_mass"] > rows[-1]["actor/distillation/student_mass"] * 0.5
    for key in ("student_mass_min", "teacher_mass_max", "overlap_ratio", "overlap_token_advantage", "loss_min", "loss_max"):
        assert f"actor/distillation/{key}" in rows[-1], key


def test_k3_with_task_rewards_adds_the_policy_loss(tmp_path, tiny_config, teacher):
    cfg = tiny_config(tmp_path, *on(teacher, "distillation.distillation_loss.distillation_loss_coef=0.5",
                                    "trainer.total_training_steps=2", "trainer.test_freq=-1"))
    driver.build(cfg, progress=False).run()
    row = read(tmp_path)[-1]
    assert {"actor/pg_loss", "actor/distillation/loss", "actor/distillation/abs_loss"} <= set(row)
    assert row["actor/distillation/loss"] > 0  # k3 >= 0, and two models of other weights differ


def test_the_teacher_is_profiled_as_a_role_with_a_stage_of_its_own(tmp_path, tiny_config, teacher):
    cfg = tiny_config(tmp_path, *on(teacher, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                                    "global_profiler.tool=torch", "global_profiler.steps=[2]",
                                    "distillation.profiler.enable=true",
                                    "distillation.profiler.tool_config.torch.discrete=true"))
    driver.build(cfg, progress=False).run()
    manifest = [json.loads(line) for line in (tmp_path / "profile" / "manifest.jsonl").read_text().splitlines()]
    teacher_traces = [r for r in manifest if r["role"] == "teacher" and r["stage"] == "teacher"]
    assert teacher_traces and (tmp_path / "profile" / teacher_traces[0]["path"]).is_file()
    spans = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert [s for s in spans if s.get("stage") == "teacher" or s.get("name") == "teacher"]
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "teacher" in (tmp_path / "report" / "index.html").read_text()


def train_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    from tests.conftest import TINY
    return subprocess.run([sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY,
                           f"trainer.default_local_dir={tmp_path}", *args], capture_output=True, text=True, timeout=300)


def test_a_teacher_with_another_tokenizer_is_one_line(tmp_path):
    other = tmp_path / "other"
    create_tiny_model(other, size="xs", seed=3)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {("Z" + k if v == 40 else k): v for k, v in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    proc = train_cli(tmp_path, *on(str(other)))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: config error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "distillation.teacher_models.teacher_model.model_path" in errors[0] and "not the student's" in errors[0]


def test_rows_no_teacher_is_routed_to_are_one_line(tmp_path, teacher):
    proc = train_cli(tmp_path, "distillation.enabled=true", "~distillation.teacher_models.teacher_model",
                     "+distillation.teacher_models.a.key=gsm8k", f"+distillation.teacher_models.a.model_path={teacher}",
                     "+distillation.teacher_models.b.key=math", f"+distillation.teacher_models.b.model_path={teacher}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: config error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "distillation.teacher_key='data_source'" in errors[0] and "arithmetic" in errors[0]


def test_the_opd_demo_preset_names_the_built_in_teacher(capsys):
    from plait.builtin_models import builtin_model
    from plait.cli import builtin_config, main
    cfg = load_config(builtin_config("opd_demo"), [])
    d = cfg.distillation
    assert d.enabled and d.teachers()["default"].model_path == "demo-grpo-teacher"
    assert (d.distillation_loss.loss_mode, d.distillation_loss.use_policy_gradient, d.distillation_loss.use_task_rewards) == \
        ("k1", True, False)
    assert cfg.actor_rollout_ref.model.path is None  # the demo's student
    assert builtin_model("demo-grpo-teacher") is not None
    assert main(["config", "show", "--config", "opd_demo"]) == 0  # the preflight passes without building the teacher


@pytest.mark.ray
def test_top_k_distillation_on_two_fsdp2_ranks_equals_one_process(tmp_path, tiny_config, teacher):
    # the student's top-k gather runs in the sharded LM head there (logprobs._sharded_logprobs), the teacher on both
    # ranks each scoring its half of the rows, the extremes reduced over ranks
    topk = ("distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=4",
            "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1")
    driver.build(tiny_config(tmp_path / "local", *on(teacher, *topk)), progress=False).run()
    driver.build(tiny_config(tmp_path / "ray", *on(teacher, *topk, "trainer.backend=ray", "trainer.ray.num_cpu_workers=2",
                                                   "actor_rollout_ref.actor.strategy=fsdp2")), progress=False).run()
    local, ray = read(tmp_path / "local")[-1], read(tmp_path / "ray")[-1]
    for key in ("loss", "student_mass", "teacher_mass_min", "loss_max", "overlap_ratio"):
        assert ray[f"actor/distillation/{key}"] == pytest.approx(local[f"actor/distillation/{key}"], rel=1e-4, abs=1e-7), key


def test_a_truncated_teacher_is_one_line_naming_its_key(tmp_path, tiny_config, capsys):
    """A teacher's safetensors cut short (a copy interrupted, a full disk): one line, exit 2, no traceback."""
    import shutil

    from plait import cli
    from tests.conftest import TINY
    broken = tmp_path / "teacher"
    shutil.copytree(create_tiny_model(tmp_path / "t", size="xs", seed=7), broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    code = cli.main(["train", "--no-progress", *TINY, f"trainer.default_local_dir={tmp_path / 'run'}",
                     "trainer.total_training_steps=1", *on(str(broken))])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "distillation.teacher_models.teacher_model.model_path=" in err and "truncated or corrupt" in err


@pytest.mark.ray
@pytest.mark.parametrize("workers", [1, 2])
def test_the_teachers_ray_worker_killed_is_restarted_once_a_step_and_the_run_completes(tmp_path, tiny_config, teacher,
                                                                                      capfd, workers):
    """The teacher on a pool of its own (distillation.nnodes=1): its rank-0 worker process killed as steps 2 and 3
    learn comes back on a new process (two workers: both, in a new torch.distributed world of their own), the teacher
    log-prob call is re-issued there, and the run completes; each restart is counted and said once."""
    import os
    import signal

    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    cfg = tiny_config(tmp_path / "run", *on(teacher, "trainer.backend=ray", "trainer.ray.num_cpu_workers=1",
                                            "trainer.ray.cpus_per_worker=0.5", "distillation.nnodes=1",
                                            f"distillation.n_gpus_per_node={workers}", "trainer.total_training_steps=3",
                                            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1"))
    lifecycle = driver.build(cfg, progress=False)
    trainer, killed = lifecycle.trainer, []
    group, learn = trainer.roles.teacher, trainer.learn

    def learning(batch, timer, *rest):
        if trainer.step in (2, 3):
            killed.append(group.pids[0])
            os.kill(killed[-1], signal.SIGKILL)
        return learn(batch, timer, *rest)
    trainer.learn = learning
    lifecycle.run()
    assert len(killed) == 2 and group.pids[0] not in killed
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "timing_s/step" in r]
    assert [(r["step"], r["distillation/teacher_restarts"]) for r in records] == [(1, 0), (2, 1), (3, 1)]
    assert all(math.isfinite(r["actor/distillation/loss"]) for r in records)
    err = capfd.readouterr().err
    for step in (2, 3):
        assert err.count(f"plait: warning: the teacher died in step {step} (its Ray worker process died during ") == 1
    assert "Traceback" not in err


def test_a_teacher_dead_twice_in_one_step_ends_the_run_in_one_line(tmp_path, tiny_config, teacher, monkeypatch):
    """A second death in the step of a restart is the run's error, planted here on the local backend."""
    from plait.errors import EngineDied, EngineFailed
    from plait.workers.teacher import Teacher
    lifecycle = driver.build(tiny_config(tmp_path / "run", *on(teacher, "trainer.total_training_steps=3")), progress=False)
    trainer, deaths, score = lifecycle.trainer, [], Teacher.compute_teacher_log_prob

    def dying(worker, batch):
        if trainer.step == 2:
            deaths.append(trainer.step)
            raise EngineDied("its Ray worker process died during Teacher.compute_teacher_log_prob")
        return score(worker, batch)
    monkeypatch.setattr(Teacher, "compute_teacher_log_prob", dying)
    with pytest.raises(EngineFailed) as failed:
        lifecycle.run()
    assert deaths == [2, 2] and str(failed.value) == (
        "the teacher failed again in step 2, after a restart in the same step: its Ray worker process died during "
        "Teacher.compute_teacher_log_prob")
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "timing_s/step" in r]
    assert [(r["step"], r["distillation/teacher_restarts"]) for r in records] == [(1, 0)]
