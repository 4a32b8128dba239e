"""Each suggestion's predicted peak memory (plait/profiler/analysis/memory_fit.py): on a planted run (one-sample
micro-batches) the micro-batch suggestion's predicted process peak is within 30 % of what the rerun with it
measured, as `plait profile diff` prints it; on hand-made facts with a GPU's numbers the fit is checked by
hand, and a suggestion that would fill the device's memory is not offered as printed."""

import json

import pytest

from plait import cli
from plait.profiler.analysis import memory_fit
from plait.profiler.analysis import verdict as V
from tests.profiler.test_verdict_planted import TINY_MICRO, first, planted

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def test_the_micro_batch_suggestion_predicts_the_reruns_peak(tmp_path, tiny_config, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    v = first(planted(before, tiny_config, *TINY_MICRO))
    assert (v["rule"], v["key"], v["value"]) == ("update_cost", MICRO, 4)
    mem = v["memory"]
    assert mem["stages"]["update_actor"]["tokens_ratio"] == 4  # 1 -> 4 samples of the same width
    assert mem["fixed_gb"] <= mem["now"]["actor"] <= mem["after"]["actor"] == v["predicted"]["actor_peak_gb"]
    predicted = v["predicted"]["peak_gb"]
    assert "process peak memory about" in v["line"]
    planted(after, tiny_config, f"{v['key']}={v['value']}")
    capsys.readouterr()
    assert cli.main(["profile", "diff", str(before), str(after), "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out)["predictions"] if r["quantity"] == "peak_gb")
    measured = row["b_measured"]
    print(f"process peak: predicted {predicted:.4f} GB, measured {measured:.4f} GB (was {row['a_measured']:.4f} GB)")
    assert row["predicted"] == predicted and abs(measured - predicted) <= 0.3 * measured
    assert cli.main(["profile", "diff", str(before), str(after)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "(update_cost): peak_gb:" in line)
    assert line == (f"A's verdict (update_cost): peak_gb: A {row['a_measured']:.3g} GB, predicted {predicted:.3g} GB; "
                    f"B measured {measured:.3g} GB ({measured / predicted:.2f}x the prediction); B has {MICRO}=4")


def gpu_facts(capacity: float, micro: int, update_gb: float = 30.0) -> V.Facts:
    """A sync run whose update is 80 % of the step, with a GPU's per-stage peaks: 10 GB held all step
    (adv), the update's one-sample micro-batches 20 GB above it, old_log_prob's 16 rows at once 12 GB."""
    peaks = {"adv": 10.0, "old_log_prob": 22.0, "update_actor": update_gb, "step": update_gb}
    metrics = {f"memory/{k}/peak_allocated_gb": v for k, v in peaks.items()}
    metrics["memory/update_actor/peak_reserved_gb"] = update_gb + 5  # the allocator's cache: not read
    settings = {"trainer.mode": "sync", "trainer.backend": "local", "device": "cuda", "memory_capacity_gb": capacity,
                "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 2, MICRO: micro, "actor_rollout_ref.actor.ppo_epochs": 1}
    return V.Facts(steps=3, step_s=1.0, trainer={"update_actor": 0.8, "old_log_prob": 0.1},
                   trainer_s={"update_actor": 0.8, "old_log_prob": 0.1}, rollouter={}, rollout_busy_s=0.0,
                   metrics=metrics, wall={}, settings=settings,
                   memory_peak={"gb": update_gb, "stage": "update_actor", "step": 2,
                                "metric": "memory/update_actor/peak_allocated_gb"})


def test_the_fit_by_hand_and_a_suggestion_that_would_not_fit():
    roomy = V.verdicts(gpu_facts(200.0, 1))[0]  # 1 -> 4 samples: 10 + 20 x 4 = 90 GB
    assert (roomy.key, roomy.value) == (MICRO, 4)
    assert roomy.memory["counter"] == "peak_allocated_gb" and roomy.memory["fixed_gb"] == 10.0
    assert roomy.predicted["peak_gb"] == roomy.predicted["actor_peak_gb"] == pytest.approx(90.0)
    assert "process peak memory about 90 GB instead of 30 GB" in roomy.line()

    full = V.verdicts(gpu_facts(80.0, 1))[0]  # 90 GB of 80: not offered; 3 samples (70 GB) stay under 72
    assert full.key == "" and full.value is None and full.predicted["peak_gb"] == pytest.approx(90.0)
    assert full.advice == (f"{MICRO} would be the lever, but its predicted process peak 90 GB is 112 % of the device's "
                           f"80 GB (at or above 90 %: out of memory likely); {MICRO}=3 is predicted to stay under")
    assert f"try: {MICRO} would be the lever" in full.line()


def test_a_suggestion_that_lowers_memory_is_offered_near_the_limit():
    """memory_full halves the micro-batch of a stage at 94 % of the device: its prediction falls, so it stands."""
    v = next(v for v in V.verdicts(gpu_facts(32.0, 2)) if v.rule == "memory_full")
    assert (v.key, v.value) == (MICRO, 1)
    assert v.memory["after"]["actor"] == pytest.approx(22.0)  # update 10 + 20 / 2 = 20; old_log_prob's 22 stays
    assert v.predicted["peak_gb"] == pytest.approx(22.0)


def test_token_ratios_for_the_length_and_packing_keys():
    f = gpu_facts(200.0, 1)
    f.metrics.update({"prompt_length/max": 8.0, "response_length/max": 56.0, V.PADDING: 0.25})
    f.settings["data.max_response_length"] = 64
    assert memory_fit.token_ratios(f, "data.max_response_length", 16)["update_actor"] == pytest.approx(24 / 64)
    assert memory_fit.token_ratios(f, "actor_rollout_ref.model.use_remove_padding", True)["old_log_prob"] == 0.75
    assert memory_fit.token_ratios(f, "trainer.test_freq", 10) == {}
    assert memory_fit.token_ratios(f, "trainer.mode", "one_step_off") is None
    ray = V.Facts(**{**vars(f), "settings": {**f.settings, "trainer.backend": "ray"}})
    assert memory_fit.predict(ray, MICRO, 4)["why"].startswith("the Ray backend's workers record no per-stage memory")
