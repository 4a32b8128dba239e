"""bench/verl_corpus.py reads a verl script's trainer call as bash expands it: variables as the
script sets them, an unset one empty, a launcher's SLURM variables set, calls behind `ray job
submit --`, piped to tee or put in the background, and a script's own shell mistakes kept (verl gets them too)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

spec = importlib.util.spec_from_file_location("verl_corpus", Path(__file__).parents[1] / "bench" / "verl_corpus.py")
corpus = importlib.util.module_from_spec(spec)
sys.modules["verl_corpus"] = corpus
spec.loader.exec_module(corpus)

SCRIPT = r"""set -xeuo pipefail
export LD_PRELOAD="/no/such/libjemalloc.so.2"  # the loader complains on stderr, into the pipe to tee
MODEL=${MODEL:-"$HOME/models/Qwen2.5-7B"}
n_resp=$((2 * 8))
GPUS=$(nvidia-smi -L | wc -l)
rm -f KEEP
python3 -c "import torch; print(torch.cuda.device_count())"
ray job submit --address=http://127.0.0.1:8265 -- python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.n=${n_resp} \
    trainer.n_gpus_per_node=$GPUS \
    trainer.nnodes=${SLURM_JOB_NUM_NODES} \
    trainer.experiment_name='a b' \
    trainer.resume_from_path=$RESUME_PATH "$@" 2>&1 | tee "$HOME/train.log"
python3 -m recipe.dapo.main_dapo algorithm.filter_groups.enable=True \  # a comment after an escaped space
    data.train_batch_size=4 &
"""


def test_a_scripts_trainer_calls_are_read_as_bash_expands_them(tmp_path):
    (tmp_path / "keep").write_text("no external command runs")
    (tmp_path / "run.sh").write_text(SCRIPT.replace("KEEP", str(tmp_path / "keep")))
    (tmp_path / "work").mkdir()
    calls = corpus.trainer_calls(tmp_path / "run.sh", tmp_path, tmp_path / "work")
    modules = [corpus.module_of(c) for c in calls]
    trainers = [(m, a) for m, a in modules if corpus.classify(m) != "other"]
    assert [m for m, _ in modules] == [None, "verl.trainer.main_ppo", "recipe.dapo.main_dapo"]  # python3 -c is no trainer
    (ppo, ppo_args), (dapo, dapo_args) = trainers
    assert ppo_args == [f"actor_rollout_ref.model.path={tmp_path / 'work' / 'home'}/models/Qwen2.5-7B",
                        "actor_rollout_ref.rollout.n=16", "trainer.n_gpus_per_node=", "trainer.nnodes=1",
                        "trainer.experiment_name=a b", "trainer.resume_from_path="]
    assert dapo_args == ["algorithm.filter_groups.enable=True", " "]  # bash's `\ ` and the comment end the call
    assert (tmp_path / "keep").exists()  # `rm` did not run


def test_megatron_calls_are_told_apart():
    assert corpus.is_megatron(["--config-name=ppo_megatron_trainer", "a=1"])
    assert corpus.is_megatron(["actor_rollout_ref.actor.strategy=megatron"])
    assert corpus.is_megatron(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert not corpus.is_megatron(["actor_rollout_ref.actor.strategy=fsdp2", "trainer.experiment_name=x"])


FAPO_REWARD = """
async def compute_score_fapo(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                             reward_model_tokenizer):
    return 0.0

def compute_score_baseline(solution_str, ground_truth, **kwargs):
    return 0.0
"""


def test_a_judges_reward_model_becomes_a_causal_lm_and_its_stub_takes_verls_keywords(tmp_path):
    """FAPO's run_fapo_7b.sh: its reward function takes reward_router_address, so its reward model (FAPO-GenRM-4B)
    is a judge: replaced by a causal LM, not a classifier; the judge's sglang engine by hf. Its baseline script
    (no reward model, a function without the keyword) keeps the plain stub."""
    (tmp_path / "recipe" / "fapo").mkdir(parents=True)
    (tmp_path / "recipe" / "fapo" / "reward_fn_reasoning.py").write_text(FAPO_REWARD)
    fixtures = {"model": "/m", "classifier": "/rm", "judge": "/judge", "train": "/t", "val": "/v",
                "out": str(tmp_path / "out")}
    args = ["reward_model.enable=True", "reward_model.model.path=/models/FAPO-GenRM-4B", "reward_model.rollout.name=sglang",
            "custom_reward_function.path=recipe/fapo/reward_fn_reasoning.py", "custom_reward_function.name=compute_score_fapo"]
    out, replaced = corpus.substitute(args, fixtures, tmp_path)
    assert "reward_model.model.path=/judge" in out and "reward_model.rollout.name=hf" in out
    stub = next(a for a in out if a.startswith("custom_reward_function.path=")).split("=", 1)[1]
    assert "async def compute_score_fapo(" in open(stub).read() and "reward_router_address" in open(stub).read()
    baseline = [a.replace("compute_score_fapo", "compute_score_baseline") for a in args]
    out, _ = corpus.substitute(baseline, fixtures, tmp_path)
    assert "reward_model.model.path=/rm" in out
    assert "reward_router_address" not in open(next(a for a in out if a.startswith("custom_reward_function.path=")).split("=", 1)[1]).read()


def test_distillation_teachers_get_the_tiny_model_and_the_call_is_accepted(tmp_path):
    # verl 0.9.1's multi-teacher OPD scripts name hub models for each teacher; the corpus gives every teacher the
    # tiny model (which shares the student's tokenizer, as a teacher must) and loads the call as plait train does
    from plait.data.tasks import write_task_files
    from plait.models import create_tiny_model
    model = create_tiny_model(tmp_path / "model", size="xs")
    train, val = write_task_files("arithmetic", tmp_path / "data", 8, 4)
    args = ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "data.train_files=x.parquet", "data.val_files=y.parquet",
            "distillation.enabled=True", "distillation.n_gpus_per_node=4", "distillation.nnodes=1",
            "+distillation.teacher_models.math.key=openai/gsm8k", "+distillation.teacher_models.math.model_path=Qwen/Qwen3-32B",
            "+distillation.teacher_models.math.num_replicas=1", "+distillation.teacher_models.geo.key=hiyouga/geometry3k",
            "+distillation.teacher_models.geo.model_path=Qwen/Qwen3-VL-32B-Instruct",
            "+distillation.teacher_models.geo.num_replicas=1", "distillation.distillation_loss.loss_mode=k1",
            "distillation.distillation_loss.use_policy_gradient=True"]
    fixtures = {"model": model, "classifier": model, "judge": model, "train": train, "val": val, "out": str(tmp_path / "out")}
    out, replaced = corpus.substitute(args, fixtures, tmp_path)
    assert {"distillation.teacher_models.math.model_path", "distillation.teacher_models.geo.model_path"} <= set(replaced)
    assert f"+distillation.teacher_models.geo.model_path={model}" in out
    accepted, error = corpus.load("verl.trainer.main_ppo", out)
    assert accepted, error
