"""verl's two in-stage knobs on a real session and real traces.

`tool_config.torch.schedule` (skip_first/wait/warmup/active/repeat) is a torch.profiler schedule
stepped once per update mini-batch: the trace keeps only the active mini-batches (and, continuous,
what ran before them when nothing is skipped). The rollout's `profile_token_start/end` keep only
the decode steps of that response-token range in the trace, on the generating thread only.
"""

import gzip
import json
import logging
import os
import threading
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plait.configtree import ConfigError, build
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.profiler.tools.torch import scheduled_mini_batches
from plait.workers.rollout_engine import SamplingParams, TransformersEngine

torch.set_num_threads(1)


def role(discrete=False, schedule=None, tokens=(None, None)):
    return build(RoleProfilerConfig, {"enable": True, "tool_config": {"torch": {
        "discrete": discrete, "schedule": schedule or {}, "profile_token_start": tokens[0],
        "profile_token_end": tokens[1]}}})


def session(tmp_path, roles):
    g = GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(tmp_path / "profile"))
    return ProfilerSession(g, roles, rank=0)


def names(tmp_path, record) -> Counter:
    with gzip.open(os.path.join(tmp_path / "profile", record["path"]), "rt") as f:
        return Counter(e.get("name") for e in json.load(f)["traceEvents"] if e.get("ph") == "X")


def update(s, mini_batches=3):
    """A real update loop: one optimizer step per mini-batch, each wrapped as the actor wraps them."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    actor = s.for_role("actor")
    with s.for_role("rollout").annotate("gen"):
        torch.randn(4, 8).sum()
    with actor.annotate("update_actor", scheduled=True):
        for i in range(mini_batches):
            with actor.mini_batch(i):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()


def test_continuous_schedule_keeps_only_the_active_mini_batches(tmp_path):
    s = session(tmp_path, {"actor": role(schedule={"wait": 1, "active": 1}), "rollout": role()})
    s.start(1, 1, 0)
    update(s)
    [record] = s.stop()
    assert record["path"] == "step1/actor-rollout_rank0.pt.trace.json.gz" and record["complete"]
    seen = names(tmp_path, record)
    # wait=1 skips mini-batch 0 (and the rollout's gen before it), active=1 keeps mini-batch 1, repeat 0
    # means one cycle in a continuous window, so mini-batch 2 is not recorded either
    assert seen["actor/mini_batch1"] == 1 and seen["aten::mm"] >= 1
    assert not {"actor/mini_batch0", "actor/mini_batch2", "rollout/gen"} & set(seen)
    assert not any(n.startswith("ProfilerStep#") for n in seen)


def test_continuous_schedule_from_the_top_keeps_the_stages_before(tmp_path):
    s = session(tmp_path, {"actor": role(schedule={"active": 2}), "rollout": role()})
    s.start(1, 1, 0)
    update(s)
    [record] = s.stop()
    seen = names(tmp_path, record)
    assert {"rollout/gen", "actor/mini_batch0", "actor/mini_batch1"} <= set(seen)
    assert "actor/mini_batch2" not in seen


def test_without_schedule_every_mini_batch_is_recorded(tmp_path):
    s = session(tmp_path, {"actor": role(), "rollout": role()})
    s.start(1, 1, 0)
    update(s)
    [record] = s.stop()
    seen = names(tmp_path, record)
    assert {"rollout/gen", "actor/update_actor", "actor/mini_batch0", "actor/mini_batch1", "actor/mini_batch2"} <= set(seen)


def test_discrete_schedule_gives_one_file_per_active_cycle_of_the_update_stage(tmp_path):
    s = session(tmp_path, {"actor": role(discrete=True, schedule={"active": 1, "repeat": 2}),
                           "rollout": role(discrete=True)})
    s.start(1, 1, 0)
    update(s)
    records = s.stop()
    paths = sorted(r["path"] for r in records)
    assert paths == ["step1/actor_rank0_update_actor_mb0.pt.trace.json.gz",
                     "step1/actor_rank0_update_actor_mb1.pt.trace.json.gz",
                     "step1/rollout_rank0_gen.pt.trace.json.gz"]
    by_path = {r["path"]: names(tmp_path, r) for r in records}
    assert "actor/mini_batch0" in by_path[paths[0]] and "actor/mini_batch1" not in by_path[paths[0]]
    assert "actor/mini_batch1" in by_path[paths[1]] and "actor/mini_batch0" not in by_path[paths[1]]
    assert "rollout/gen" in by_path[paths[2]]  # the other stages are traced whole, unscheduled


def test_a_schedule_past_the_last_mini_batch_records_nothing_and_says_so(tmp_path, caplog):
    s = session(tmp_path, {"actor": role(schedule={"skip_first": 5, "active": 1}), "rollout": role()})
    s.start(1, 1, 0)
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        update(s)
        assert s.stop() == []
    assert any("recorded nothing in steps 1-1" in r.getMessage() for r in caplog.records)


def test_mini_batch_range_of_a_saved_cycle():
    sched = dict(skip_first=1, wait=1, warmup=1, active=2, repeat=0)
    assert scheduled_mini_batches(sched, 5) == (3, 4)    # skip 0, wait 1, warm 2, keep 3-4
    assert scheduled_mini_batches(sched, 9) == (7, 8)    # the next cycle: wait 5, warm 6, keep 7-8
    assert scheduled_mini_batches(sched, 8) == (7, 7)    # a cycle the loop ended mid-way


def test_roles_in_one_process_must_agree_on_the_schedule(tmp_path):
    with pytest.raises(ConfigError, match="same schedule"):
        session(tmp_path, {"actor": role(schedule={"active": 1}), "critic": role(schedule={"active": 2})})
    session(tmp_path, {"actor": role(schedule={"active": 1}), "critic": role()})  # the critic does not step it


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64)).eval()
    return TransformersEngine(model, pad_token_id=0, eos_token_ids=[])


def generate(s, engine, n=8):
    with s.for_role("rollout").annotate("gen"), s.for_role("rollout").decode_steps() as gate:
        out = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=n), torch.Generator().manual_seed(0),
                              on_forward=gate)
    assert out.responses.shape == (2, n)  # the gate changes what is recorded, never what is generated


def test_token_range_records_only_those_decode_steps(tmp_path, engine):
    s = session(tmp_path, {"rollout": role(tokens=(2, 5))})
    s.start(1, 1, 0)
    other = threading.Thread(target=lambda: [torch.randn(4, 4).tanh() for _ in range(50)])
    other.start()  # another thread's ops are recorded all the while
    generate(s, engine)
    other.join()
    [record] = s.stop()
    seen = names(tmp_path, record)
    assert {n for n in seen if n.startswith("rollout/token")} == {"rollout/token2", "rollout/token3", "rollout/token4"}
    # one embedding lookup and one draw per forward: the prefill (token 0) and steps 1, 5-7 are left out
    assert seen["aten::embedding"] == 3 and seen["aten::searchsorted"] == 3
    assert seen["rollout/gen"] == 1 and seen["aten::tanh"] == 50
    assert torch._C._autograd._profiler_enabled() is False


def test_no_token_range_records_every_decode_step(tmp_path, engine):
    s = session(tmp_path, {"rollout": role()})
    s.start(1, 1, 0)
    generate(s, engine)
    [record] = s.stop()
    seen = names(tmp_path, record)
    assert seen["aten::searchsorted"] == 8 and not any(n.startswith("rollout/token") for n in seen)


def test_open_ended_token_range(tmp_path, engine):
    s = session(tmp_path, {"rollout": role(tokens=(6, None))})
    s.start(1, 1, 0)
    generate(s, engine)
    [record] = s.stop()
    assert {n for n in names(tmp_path, record) if n.startswith("rollout/token")} == {"rollout/token6", "rollout/token7"}
    # recording is back on for this thread after the call
    s.start(1, 1, 0)
    with s.for_role("rollout").annotate("after"):
        torch.randn(2, 2).exp()
    [record] = s.stop()
    assert {"rollout/after", "aten::exp"} <= set(names(tmp_path, record))
