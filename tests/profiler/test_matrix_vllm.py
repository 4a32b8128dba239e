"""The profiler contract matrix with the engine as an axis: rollout.name=vllm in every LM mode.

tests/profiler/test_matrix.py checks the contract with plait's own engine (hf) in every mode x
tool x selection. Here the same checks run with vLLM's engine, whose model generates in its own
engine-core process: each window that profiles the rollout holds, besides the worker process's
artifact, `rollout_rank0_vllm_engine.pt.trace.json.gz` written by vLLM's own profiler, listed in
the manifest with role, stage `vllm_engine`, rank, steps and the window's policy version, and
holding the engine core's attention ops (with torch_memory: its allocations too). The cases are
the matrix's rollout-profiling selections, one engine start each (about 30 s on 2 cores), so the
vLLM CI environment stays small: a continuous two-step window in every mode, plus in sync a
discrete window and a torch_memory window.
"""

import gzip
import json
import logging
import os

import pytest
import torch

from plait import driver
from plait.profiler import read_manifest
from plait.trainers.lifecycle import read_metrics

from test_matrix import BEYOND, CASES, MODES, Case, all_files, expected_records, expected_stage_names, \
    load_artifact, profile_overrides

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
torch.set_num_threads(1)

STEPS = 3  # every window here ends by step 3
VLLM = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_model_len=512",
        "actor_rollout_ref.rollout.enforce_eager=True")
ENGINE = "vllm_engine"
GENERATION_OP = "vllm::unified_attention"  # the model's attention, run by the engine core as it generates
LM_MODES = {m.name: m for m in MODES if m.name != "diffusion"}
CASE = {c.name: c for c in CASES}
STEP1_PAIR = Case("step1_pair", (1,), False, ((1, 1),), roles="pair")
ENGINE_MATRIX = [pytest.param(LM_MODES[mode], tool, case, id=f"{mode}-{tool}-{case.name}") for mode, tool, case in (
    ("sync", "torch", CASE["2-3_continuous"]),
    ("sync", "torch", CASE["2_discrete"]),
    ("sync", "torch_memory", STEP1_PAIR),
    ("one_step_off", "torch", CASE["2-3_continuous"]),
    ("fully_async", "torch", CASE["2-3_continuous"]),
)]


def with_engine_records(mode, case: Case, tool: str) -> list[dict]:
    """The hf matrix's records, plus the engine core's trace in every window that profiles the rollout."""
    out = expected_records(mode, case, tool)
    if "rollout" in case.profiled(mode):
        for first, last in case.windows_for(tool):
            span = f"step{first}" if first == last else f"step{first}-{last}"
            out.append({"steps": [first, last], "rank": 0, "tool": tool, "policy_version": first - 1,
                        "complete": True, "role": "rollout", "stage": ENGINE,
                        "path": f"{span}/rollout_rank0_{ENGINE}.pt.trace.json.gz"})
    return sorted(out, key=lambda r: r["path"])


@pytest.mark.parametrize("mode, tool, case", ENGINE_MATRIX)
def test_profiler_contract_with_vllm(mode, tool, case, tmp_path, tiny_config, vllm_model_path, caplog, capfd):
    save = tmp_path / "profile"
    overrides = [*mode.overrides, *VLLM, f"actor_rollout_ref.model.path={vllm_model_path}",
                 f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                 *profile_overrides(mode, case, tool, tmp_path)]
    cfg = tiny_config(tmp_path / "out", *overrides)
    # said at start: what vLLM's engine-core process records
    assert f"rollout.name=vllm with {tool}: the generation runs in vLLM's engine-core process" in capfd.readouterr().err
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        driver.build(cfg, progress=False).run()

    assert [r["step"] for r in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))] == list(range(1, STEPS + 1))
    records = read_manifest(str(save))
    expected = with_engine_records(mode, case, tool)
    keys = ("steps", "role", "stage", "rank", "tool", "path", "policy_version", "complete")
    assert sorted(({k: r[k] for k in keys} for r in records), key=lambda r: str(r["path"])) == expected
    assert all(r["pid"] == os.getpid() and r["start_time"] <= r["end_time"] for r in records)
    assert all_files(save) == sorted(["manifest.jsonl", *(r["path"] for r in expected)])

    for record in records:
        path = str(save / record["path"])
        if record["stage"] == ENGINE:  # vLLM's own trace: the engine core's model ops, from its own process
            with gzip.open(path, "rt") as f:
                events = json.load(f)["traceEvents"]
            ops = [e for e in events if e.get("name", "").startswith(GENERATION_OP)]
            assert ops and os.getpid() not in {e.get("pid") for e in ops}, record["path"]
            allocs = any(e.get("name") == "[memory]" and e["args"]["Bytes"] > 0 for e in events)
            assert allocs == (tool == "torch_memory"), f"{record['path']}: allocations recorded {allocs}"
            continue
        names, allocs = load_artifact(path)
        assert expected_stage_names(mode, case, record) <= names, (record["path"], sorted(n for n in names if "/" in n))
        assert allocs or tool != "torch_memory", f"{record['path']} shows no allocations"

    assert (tmp_path / "hook_ran").read_text().split() == [tool, "driver", "0", str(save), str(len(expected))]
    assert not [r.getMessage() for r in caplog.records if BEYOND in r.getMessage()]
    assert not [r for r in caplog.records if r.name.startswith("plait") and "failed" in r.getMessage()]  # no tool error


def test_token_range_bounds_the_engine_trace(tmp_path, tiny_config, vllm_model_path, capfd):
    """profile_token_start/end become vLLM's delay_iterations/max_iterations (as in verl): step 1's engine
    trace holds the attention of a few engine iterations, not of all 16 decode steps."""
    save, start, end = tmp_path / "profile", 2, 4
    cfg = tiny_config(tmp_path / "out", *VLLM, f"actor_rollout_ref.model.path={vllm_model_path}",
                      "trainer.total_training_steps=1", "trainer.test_freq=-1", "data.max_response_length=16",
                      "actor_rollout_ref.rollout.ignore_eos=True", "global_profiler.tool=torch",
                      "global_profiler.steps=[1]", f"global_profiler.save_path={save}",
                      "actor_rollout_ref.rollout.profiler.enable=True",
                      f"actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start={start}",
                      f"actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end={end}")
    assert f"only engine iterations {start} to {end - 1} of each window" in capfd.readouterr().err
    driver.build(cfg, progress=False).run()
    [engine] = [r for r in read_manifest(str(save)) if r["stage"] == ENGINE]
    with gzip.open(save / engine["path"], "rt") as f:
        ops = [e for e in json.load(f)["traceEvents"] if e.get("name", "").startswith(GENERATION_OP)]
    with open(os.path.join(vllm_model_path, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    # one attention op per layer per engine iteration; vLLM counts its bounds inclusively, so allow one more
    assert layers <= len(ops) <= layers * (end - start + 1), (len(ops), layers)
    assert read_metrics(str(tmp_path / "out" / "metrics.jsonl"))[0]["response_length/max"] == 16
