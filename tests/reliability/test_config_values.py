"""Every bad config value is refused with one line naming the key (exit 2 from the CLI), and
random malformed overrides either build a sane config or are refused: a property-based fuzz."""

import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from plait.config import PlaitConfig, load_config
from plait.configtree import ConfigError, ConfigErrors, to_dict


def leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{path}.")
        else:
            yield path, value


KEYS = sorted(k for k, _ in leaves(to_dict(PlaitConfig())))
HOSTILE = ["-1", "0", "-0.5", "1.5", "1e30", "-1e30", "inf", "-inf", "nan", ".inf", ".nan", "''", "../../etc",
           "a/b", "..", "[1, -2]", "{}", "null", "true", "x" * 300, str(2**63), "[]", "1e-400"]


def sane(cfg: PlaitConfig) -> list[str]:
    """Invariants every accepted config keeps; the fuzz reports any it breaks."""
    problems = [f"{k}={v}" for k, v in leaves(to_dict(cfg)) if isinstance(v, float) and not math.isfinite(v)]
    actor = cfg.actor_rollout_ref.actor
    if not (0 <= actor.clip_ratio_low < 1 and actor.clip_ratio_high >= 0 and 0 < actor.clip_ratio <= 1):
        problems.append(f"clip ratios {actor.clip_ratio}, {actor.clip_ratio_low}, {actor.clip_ratio_high}")
    for key, node in (("actor", actor), ("critic", cfg.critic)):
        if not node.grad_clip > 0 or not node.ppo_micro_batch_size_per_gpu > 0 or not node.optim.lr > 0:
            problems.append(f"{key} grad_clip/micro batch/lr")
    if cfg.trainer.default_local_dir is None:
        out = os.path.normpath(cfg.output_dir)
        if not out.startswith("outputs" + os.sep) or out.count(os.sep) != 2:
            problems.append(f"output dir {cfg.output_dir!r} escapes outputs/<project>/<experiment>")
    if cfg.trainer.resume_from_path is not None and cfg.trainer.resume_mode != "resume_path":
        problems.append("resume_from_path set but ignored")
    return problems


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example([("diffusion.actor.sde_window_range", "[]")])  # found by this test: a ValueError unpacking []
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(HOSTILE) | st.floats().map(repr)),
                min_size=1, max_size=3))
def test_malformed_overrides_build_a_sane_config_or_are_one_named_error(overrides):
    lines = [f"{key}={value}" for key, value in overrides]
    try:
        cfg = load_config(None, lines)
    except ConfigError as err:  # one line per error, each naming a key of the tree
        for one in err.errors if isinstance(err, ConfigErrors) else [err]:
            assert "\n" not in str(one) and one.key.split("[")[0] in KEYS, str(one)
        return
    assert sane(cfg) == [], lines


@pytest.mark.parametrize("override", [
    "critic.grad_clip=-1", "actor_rollout_ref.actor.grad_clip=0", "actor_rollout_ref.actor.clip_ratio_low=-0.1",
    "actor_rollout_ref.actor.clip_ratio_high=-0.1", "actor_rollout_ref.actor.clip_ratio=1.5",
    "actor_rollout_ref.actor.clip_ratio_low=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-4",
    "critic.ppo_micro_batch_size_per_gpu=-4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-1",
    "actor_rollout_ref.actor.optim.lr=inf", "actor_rollout_ref.actor.optim.lr=nan", "critic.optim.lr=.inf",
    "trainer.project_name=../../etc", "trainer.experiment_name=a/b", "trainer.project_name=''",
    "actor_rollout_ref.actor.entropy_coeff=-1",  # resume_from_path with resume_mode=auto: verl 0.9.1 resumes from it
    "actor_rollout_ref.actor.kl_loss_coef=-1", "algorithm.kl_ctrl.target_kl=0", "trainer.nnodes=0",
    "demo.warmstart_lr=0",
])
def test_each_bad_value_is_refused_naming_its_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(key)


def test_a_key_is_refused_once_even_when_its_default_fails_the_same_check():
    """data.train_batch_size=4 fails the preset's ppo_mini_batch_size=16; the search for errors hidden behind
    it drops that key, and verl's default (256) fails the same check: one error for the key, not two."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_batch_size=4"])
    found = err.value.errors if isinstance(err.value, ConfigErrors) else [err.value]
    assert [str(e) for e in found] == ["actor_rollout_ref.actor.ppo_mini_batch_size=16: must divide data.train_batch_size=4"]
