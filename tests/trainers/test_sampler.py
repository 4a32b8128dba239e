"""verl 0.9.1's V1 sampler rules (plait/trainers/sampler.py) on scripted buffers, one test per rule, and the
same scripted sequences run through verl 0.9.1's own ReplayBufferAsync side by side.

The side-by-side test loads verl's replay_buffer.py from PLAIT_VERL_SITE (verl 0.9.1 and TransferQueue
installed aside, as .ci/run installs them; skipped without) and replaces only its storage: TransferQueue's
kv_list / kv_clear become reads and deletes of the scripted buffer, and its poll sleep a "would wait" signal.
Its eviction, wait and selection rules are verl's code, unchanged.
"""

import importlib.util
import os
import random
import sys

import pytest

from plait.trainers.sampler import GroupBuffer, ReplayBufferAsync, merge_sampler_metrics, must_wait, span, stale


class WouldWait(Exception):
    """The sampler would block here (fewer finished groups than asked, or wait's rule)."""


class ScriptedBuffer(GroupBuffer):
    def wait(self, timeout=None):
        raise WouldWait


def make(groups, threshold=2, strategy="drop", step=1):
    """A plait sampler over `groups` [(issued, status)], refilling with pending groups tagged `step`."""
    buffer = ScriptedBuffer()
    for issued, status in groups:
        g = buffer.add(f"prompt{len(buffer.groups)}", issued)
        g.status = status
    refills = []

    def refill(k):
        refills.append(k)
        for _ in range(k):
            buffer.add("fresh", step)
    sampler = ReplayBufferAsync(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=threshold,
                                max_off_policy_strategy=strategy, sampler_kwargs={}, refill_fn=refill, buffer=buffer)
    return buffer, sampler, refills


def test_span_counts_versions_from_issue_to_training():
    assert span(5, 5) == 1 and span(5, 3) == 3
    tags = {0: {"status": "finished", "global_steps": 1}, 1: {"status": "finished", "global_steps": 3},
            2: {"status": "running", "global_steps": 1}}
    assert stale(tags, 4, 3) == {0}          # span 4 > 3; the running group is not finished, so not dropped
    assert stale(tags, 4, None) == set()     # null: no version control
    assert must_wait(tags, 4, 4) and not must_wait(tags, 4, 5) and not must_wait(tags, 4, None)


def test_drop_evicts_stale_finished_groups_and_refills_as_many():
    # step 5, threshold 2: groups issued at step 1 and 3 have spans 5 and 3 (stale), those at 4 and 5 are fine
    buffer, sampler, refills = make([(1, "finished"), (3, "finished"), (4, "finished"), (5, "finished"), (5, "finished")],
                                    threshold=2, step=5)
    uids, metrics = sampler.sample(5, "train", 2)
    assert [buffer.groups[u].issued for u in uids] == [4, 5]
    assert refills == [2] and len(buffer.with_status("pending")) == 2
    assert metrics == {"training/off_policy/evicted_samples": 2, "training/off_policy/evicted_samples_staleness/mean": 4.0,
                       "training/off_policy/evicted_samples_staleness/max": 5, "training/off_policy/evicted_samples_staleness/min": 3}


def test_drop_waits_when_too_few_fresh_groups_are_finished():
    buffer, sampler, refills = make([(1, "finished"), (5, "finished"), (5, "running")], threshold=1, step=5)
    with pytest.raises(WouldWait):
        sampler.sample(5, "train", 2)
    assert refills == [1] and 0 not in buffer.groups  # the stale one went before the wait


def test_wait_blocks_while_a_group_at_the_threshold_is_in_flight():
    # strategy wait, threshold 2 at step 4: the running group issued at step 3 has span 2 (reached): wait for it,
    # although two groups are finished; nothing is dropped, even the finished group of span 4
    buffer, sampler, refills = make([(1, "finished"), (4, "finished"), (3, "running")], threshold=2, strategy="wait", step=4)
    with pytest.raises(WouldWait):
        sampler.sample(4, "train", 2)
    assert refills == [] and len(buffer.groups) == 3
    buffer.groups[2].status = "finished"
    uids, metrics = sampler.sample(4, "train", 2)
    assert [buffer.groups[u].issued for u in uids] == [1, 3] and metrics == {}


def test_wait_does_not_block_for_groups_below_the_threshold():
    buffer, sampler, _ = make([(4, "finished"), (4, "running")], threshold=2, strategy="wait", step=4)
    uids, _ = sampler.sample(4, "train", 1)
    assert uids == [0]


def test_failed_groups_are_always_evicted_and_refilled():
    for strategy in ("drop", "wait"):
        buffer, sampler, refills = make([(1, "failure"), (1, "finished"), (1, "failure")], threshold=None,
                                        strategy=strategy, step=1)
        with pytest.raises(WouldWait):
            sampler.sample(1, "train", 2)
        assert refills == [2] and buffer.with_status("failure") == []
        buffer.groups[3].status = "finished"
        uids, metrics = sampler.sample(1, "train", 2)
        assert uids == [1, 3]


def test_failure_metric_and_oldest_first():
    buffer, sampler, refills = make([(3, "finished"), (2, "finished"), (1, "failure"), (2, "finished")], threshold=None)
    uids, metrics = sampler.sample(3, "train", 2)
    assert uids == [1, 3]  # issued at step 2, in issue order; the step-3 group waits
    assert metrics == {"training/rollout_failure/evicted_samples": 1} and refills == [1]


def test_null_threshold_keeps_every_group():
    buffer, sampler, refills = make([(1, "finished"), (9, "running")], threshold=None, strategy="wait")
    assert sampler.sample(100, "train", 1)[0] == [0] and refills == []


def test_step_metrics_are_summed_as_verl_sums_them():
    acc = {}
    merge_sampler_metrics(acc, {"training/off_policy/evicted_samples": 1, "training/off_policy/evicted_samples_staleness/mean": 3.0,
                                "training/off_policy/evicted_samples_staleness/max": 3, "training/off_policy/evicted_samples_staleness/min": 3})
    merge_sampler_metrics(acc, {"training/off_policy/evicted_samples": 3, "training/off_policy/evicted_samples_staleness/mean": 5.0,
                                "training/off_policy/evicted_samples_staleness/max": 6, "training/off_policy/evicted_samples_staleness/min": 4,
                                "training/rollout_failure/evicted_samples": 2})
    assert acc == {"training/off_policy/evicted_samples": 4, "training/off_policy/evicted_samples_staleness/mean": 4.5,
                   "training/off_policy/evicted_samples_staleness/max": 6, "training/off_policy/evicted_samples_staleness/min": 3,
                   "training/rollout_failure/evicted_samples": 2}


# -- side by side with verl 0.9.1's ReplayBufferAsync ---------------------------------------------------

VERL_SITE = os.environ.get("PLAIT_VERL_SITE")


def verl_replay_buffer_module():
    if not VERL_SITE:
        pytest.skip("PLAIT_VERL_SITE (verl 0.9.1 and transferqueue installed aside) is not set")
    if VERL_SITE not in sys.path:
        sys.path.append(VERL_SITE)
    path = os.path.join(VERL_SITE, "verl", "trainer", "ppo", "v1", "replay_buffer.py")
    if importlib.util.find_spec("transfer_queue") is None or not os.path.exists(path):
        pytest.skip(f"{VERL_SITE} lacks verl 0.9.1's replay_buffer.py or transferqueue")
    # the file alone: verl.trainer.ppo.v1's package __init__ imports the whole GPU trainer
    spec = importlib.util.spec_from_file_location("verl_v1_replay_buffer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_sampler(module, state: dict, threshold, strategy, refill_fn):
    """verl's ReplayBufferAsync whose TransferQueue reads and deletes are the scripted `state`
    {uid: {"status", "global_steps"}}; its poll sleep raises WouldWait."""
    class Scripted(module.ReplayBufferAsync):
        def _sync_metadata_from_transfer_queue(self):
            for index in (self.partitions, self.pending_keys, self.running_keys, self.finished_keys, self.failure_keys,
                          self.prompt_global_steps):
                index.clear()
            for uid, tag in state.items():
                self.prompt_global_steps["train"][uid] = tag["global_steps"]
                {"pending": self.pending_keys, "running": self.running_keys, "finished": self.finished_keys,
                 "failure": self.failure_keys}[tag["status"]]["train"].add(uid)
                if tag["status"] == "finished":  # one trajectory per group is enough for the rules
                    self.partitions["train"][f"{uid}_0_0"] = {"status": "success", "global_steps": tag["global_steps"]}

        def _clear_groups(self, partition_id, uids):
            for uid in uids:
                state.pop(uid, None)
            self._sync_metadata_from_transfer_queue()

        def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
            for uid in selected_prompt_uids:
                state.pop(uid)
            return list(selected_prompt_uids)

        def _wait_for_next_poll(self, partition_id, last_debug_time):
            raise WouldWait
    return Scripted(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=threshold,
                    max_off_policy_strategy=strategy, sampler_kwargs={}, refill_fn=refill_fn)


@pytest.mark.parametrize("threshold,strategy", [(1, "drop"), (2, "drop"), (3, "drop"), (2, "wait"), (3, "wait"),
                                                (None, "drop")])
def test_same_decisions_as_verls_sampler_on_the_same_sequence(threshold, strategy):
    """Twelve steps of a scripted run (a warmup batch, then a batch issued per step; in-flight groups finish,
    fail or keep running at random; two local updates of two groups per step): at every sample both samplers
    wait or not alike, refill as many, take groups of the same issue steps, report the same metrics, and
    leave the same groups behind."""
    module = verl_replay_buffer_module()
    rng = random.Random(f"{threshold}/{strategy}")
    buffer, sampler, plait_refills = make([], threshold, strategy)
    state: dict[str, dict] = {}
    verl_refills, names, step = [], iter(range(10**6)), 1

    def plait_refill(k):
        plait_refills.append(k)
        for _ in range(k):
            buffer.add("fresh", step)

    def verl_refill(k):
        verl_refills.append(k)
        for _ in range(k):
            state[f"g{next(names)}"] = {"status": "pending", "global_steps": step}
    sampler.refill_fn = plait_refill
    verl = verl_sampler(module, state, threshold, strategy, verl_refill)
    taken_by_verl = []
    verl._materialize_batch = lambda partition, uids, snapshot: taken_by_verl.append(
        sorted(state.pop(u)["global_steps"] for u in uids)) or uids
    left = lambda: (sorted((g.issued, g.status) for g in buffer.groups.values()),  # noqa: E731
                    sorted((t["global_steps"], t["status"]) for t in state.values()))
    compared = 0
    for step in range(1, 13):
        for _ in range(8 if step == 1 else 4):
            buffer.add("p", step)
            state[f"g{next(names)}"] = {"status": "pending", "global_steps": step}
        for _ in range(2):
            # the rollout moves on: the in-flight groups of both sides, paired by (issue step, status), change alike
            plait_open = sorted((g.issued, g.status, u) for u, g in buffer.groups.items() if g.status in ("pending", "running"))
            verl_open = sorted((t["global_steps"], t["status"], int(u[1:])) for u, t in state.items()
                               if t["status"] in ("pending", "running"))
            for (*_, p_uid), (*_, v_uid) in zip(plait_open, verl_open):
                v_uid = f"g{v_uid}"
                roll = rng.random()
                new = "finished" if roll < 0.45 else "failure" if roll < 0.5 else "running" if roll < 0.8 else None
                if new:
                    buffer.groups[p_uid].status = state[v_uid]["status"] = new
            outcome = []
            for run in (lambda: sampler.sample(step, "train", 2), lambda: verl.sample(step, "train", 2)):
                try:
                    outcome.append(run())
                except WouldWait:
                    outcome.append(None)
            p, v = outcome
            assert (p is None) == (v is None), (step, p, v)
            assert plait_refills == verl_refills
            if p is not None:
                (p_uids, p_metrics), (_, v_metrics) = p, v
                assert sorted(buffer.groups[u].issued for u in p_uids) == taken_by_verl[-1]
                assert p_metrics == pytest.approx(v_metrics)
                buffer.remove(p_uids)
                compared += 1
            assert left()[0] == left()[1]
    assert compared >= 4  # the sequence reached enough samples to compare
