"""The engine seam (plait/workers/engine.py): no module outside the engine files names an engine, and a
new engine is one class plus one table row: a scripted engine registered here trains a sync step."""

import ast
import os

import torch

import plait
from plait import driver
from plait.trainers.lifecycle import read_metrics
from plait.workers.actor import Actor
from plait.workers.engine import ENGINES, EngineSpec
from plait.workers.rollout_engine import Generation

PACKAGE = os.path.dirname(plait.__file__)
ENGINE_FILES = {"workers/engine.py", "workers/rollout_engine.py", "workers/vllm_engine.py",
                "workers/vllm_notes.py"}


def package_modules() -> list[str]:
    """Every .py file of the plait package, as a path relative to it."""
    return sorted(os.path.relpath(os.path.join(root, name), PACKAGE)
                  for root, _, names in os.walk(PACKAGE) for name in names if name.endswith(".py"))


def engine_names_in(path: str) -> list[str]:
    """`line: name` for each string constant of the module that is exactly an engine's name (a comparison,
    a default, a key); sentences that mention an engine (messages, docstrings) are not names."""
    with open(os.path.join(PACKAGE, path)) as f:
        tree = ast.parse(f.read())
    return [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINES]


def test_no_module_outside_the_engine_files_names_an_engine():
    found = [hit for path in package_modules() if path not in ENGINE_FILES for hit in engine_names_in(path)]
    assert found == [], "ask the table in plait/workers/engine.py instead:\n" + "\n".join(found)


def test_the_scan_sees_a_name():  # the scan above must be able to fail
    assert any(hit.endswith("'vllm'") for hit in engine_names_in("workers/engine.py"))


class ScriptedEngine:
    """An engine from a script: row i answers with its prompt's first (i % 3) + 1 tokens, each at log-prob -1."""
    continuous = False

    def __init__(self, pad_token_id: int):
        self.pad_token_id, self.calls, self.loaded = pad_token_id, 0, None

    def generate(self, prompts, params, generator=None, on_forward=None) -> Generation:
        self.calls += 1
        width = min(3, params.max_new_tokens)
        responses = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [batch, width]
        mask = torch.zeros(len(prompts), width)                                               # [batch, width]
        for i, prompt in enumerate(prompts):
            take = min(i % 3 + 1, width, len(prompt))
            responses[i, :take] = torch.tensor(prompt[:take])
            mask[i, :take] = 1.0
        return Generation(responses, mask, -mask, ["length"] * len(prompts))

    def load_weights(self, state_dict, share=False) -> None:
        self.loaded = {k: v.clone() for k, v in state_dict.items()}

    def probe_logprobs(self, ids):
        return None  # a script has no model: the weight-sync check is off (the test checks the loads itself)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_scripted_engine_registered_by_one_row_trains_a_sync_step(tmp_path, tiny_config, monkeypatch):
    built = []

    def build(args):
        built.append(ScriptedEngine(args.pad_token_id))
        return built[-1]
    monkeypatch.setitem(ENGINES, "scripted", EngineSpec(build=build, unavailable=lambda: None))
    (tmp_path / "reward.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(len(solution_str))\n")
    cfg = tiny_config(tmp_path / "run", "actor_rollout_ref.rollout.name=scripted", "trainer.total_training_steps=1",
                      "trainer.test_freq=-1", "trainer.save_freq=-1",
                      f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=length")
    lifecycle = driver.build(cfg, progress=False)
    actor = lifecycle.trainer.roles.actor
    before = {k: v.clone() for k, v in actor.call(Actor.state_dict).items()}
    lifecycle.run()
    after = actor.call(Actor.state_dict)
    [engine] = built
    assert engine.calls == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert engine.loaded is not None and all(torch.equal(engine.loaded[k], after[k].to(engine.loaded[k].dtype))
                                             for k in after)  # the step's weights reached the engine
    [record] = read_metrics(os.path.join(tmp_path, "run", "metrics.jsonl"))
    assert record["response_length/mean"] == sum(i % 3 + 1 for i in range(16)) / 16  # the script's lengths
    assert record["actor/pg_loss"] != 0.0
