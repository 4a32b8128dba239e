"""verl's interaction loop (a simulated user answering each assistant turn) in plait's tool_agent loop,
on a scripted engine (the model's turns as text) so ids, masks, scores and limits are checked exactly.
The interactions are real: verl's GSM8K class name (plait's built-in twin) and user classes from a
file, each loaded in a worker process."""

import asyncio
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plait.agents.interactions import InteractionBox
from plait.agents.tokens import ContinuousTokens
from plait.agents.tools import ToolLimits
from plait.agents.worker import AgentWorker
from plait.config import PlaitConfig, SamplingConfig
from plait.configtree import ConfigError
from plait.models import build_char_tokenizer
from plait.trainers.metrics import agent_metrics
from plait.types import PromptBatch
from plait.workers.rollout_engine import Generation

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WRONG = "Your response is incorrect! You need to reflect on your answer and try again."
GSM8K_YAML = "interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n    config: {}\n"


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT
    return tok


class Engine:
    """Each request's turn is script(number of assistant turns so far), eos-terminated, log-prob -0.5."""

    def __init__(self, tok, script, marker="<|assistant|>"):
        self.tok, self.script, self.marker = tok, script, marker  # marker: the template's generation prompt

    def __call__(self, ids, max_new_tokens, sampling):
        rows = [self.tok.encode(self.script(self.tok.decode(p).count(self.marker) - 1), add_special_tokens=False)
                + [self.tok.eos_token_id] for p in ids]
        width = max(len(r) for r in rows)
        out, mask = torch.full((len(rows), width), self.tok.pad_token_id), torch.zeros(len(rows), width)
        reasons = []
        for i, r in enumerate(rows):
            k = min(len(r), max_new_tokens)
            out[i, :k], mask[i, :k] = torch.tensor(r[:k]), 1
            reasons.append("eos" if k == len(r) else "length")
        return Generation(out, mask, -0.5 * mask, reasons)


def box_for(tmp_path, text: str, workers: int = 2):
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent(text))
    mt = SimpleNamespace(interaction_config_path=str(path))
    return InteractionBox.from_config(mt, ToolLimits(num_workers=workers, timeout_s=20))


def generate(tok, box, script, kwargs_per_row, response_length=200, **mt):
    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, response_length
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    for k, v in mt.items():
        setattr(cfg.actor_rollout_ref.rollout.multi_turn, k, v)
    n = len(kwargs_per_row)
    batch = PromptBatch(prompt_ids=[[1]] * n, data_sources=["t"] * n, ground_truths=["5"] * n,
                        extra_infos=[{"raw_prompt": [{"role": "user", "content": f"2+3? ({i})"}], "interaction_kwargs": kw}
                                     for i, kw in enumerate(kwargs_per_row)], indices=list(range(n)), agent_names=[])
    worker = AgentWorker(cfg, tok, "qwen2", None, box)
    engine = Engine(tok, script)
    try:
        return worker.generate(batch, SamplingConfig(n=1), engine, lambda: 0)
    finally:
        worker.thread.close()


def test_gsm8k_interaction_answers_as_the_user(tmp_path, tokenizer):
    box = box_for(tmp_path, GSM8K_YAML)
    try:
        batch = generate(tokenizer, box, lambda turn: "#### 4" if turn == 0 else "#### 5",
                         [{"name": "gsm8k", "ground_truth": "5"}])
    finally:
        box.close()
    ct, eos = ContinuousTokens(tokenizer, "qwen2"), tokenizer.eos_token_id
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False) + [eos]  # noqa: E731
    user1 = ct.delta([{"role": "user", "content": WRONG}], None)
    user2 = ct.delta([{"role": "user", "content": "Your response is correct!"}], None)
    assert tokenizer.decode(user1) == f"<|user|>{WRONG}<|end|>\n<|assistant|>"
    parts = [(enc("#### 4"), 1), (user1, 0), (enc("#### 5"), 1), (user2, 0)]
    n = int(batch.attended[0].sum())
    assert batch.responses[0, :n].tolist() == [t for ids, _ in parts for t in ids]
    assert batch.response_mask[0, :n].tolist() == [m for ids, m in parts for _ in ids]  # user turns: attended, not trained
    assert batch.rollout_logprobs[0, :n].tolist() == [-0.5 * m for ids, m in parts for _ in ids]
    info = batch.extra_infos[0]
    assert info["turn_scores"] == [0.0, 1.0] and info["num_turns"] == 5  # 2 user + 2 assistant + 1
    metrics = agent_metrics(batch)
    assert metrics["agent_loop/interaction_turns_per_trajectory"] == 2.0
    assert metrics["agent_loop/interaction_error_rate"] == 0.0


def test_turn_limits_and_rows_pick_their_interaction(tmp_path, tokenizer):
    (tmp_path / "myusers.py").write_text(textwrap.dedent('''
        from plait.agents.interactions import BaseInteraction

        class Echo(BaseInteraction):
            async def start_interaction(self, instance_id=None, word="?", **kwargs):
                self.words = getattr(self, "words", {})
                self.words[instance_id] = [word]
                return instance_id

            async def generate_response(self, instance_id, messages, **kwargs):
                self.words[instance_id].append(str(len(messages)))
                return False, self.config["prefix"] + "-".join(self.words[instance_id]), 0.25, {"n": len(messages)}

            async def finalize_interaction(self, instance_id, **kwargs):
                del self.words[instance_id]
    '''))
    sys.path.insert(0, str(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        box = box_for(tmp_path, GSM8K_YAML + "  - class_name: myusers.Echo\n    config: {prefix: 'u:'}\n")
    finally:
        os.chdir(cwd)
        sys.path.remove(str(tmp_path))
    assert box.names == ["gsm8k", "echo"]  # verl's name for an entry without one: the class name, lower case
    try:
        batch = generate(tokenizer, box, lambda turn: f"a{turn}", [{"name": "echo", "word": "w"}, {"name": "gsm8k",
                         "ground_truth": "5"}], max_user_turns=2)
        with pytest.raises(ValueError, match=r"row 0: extra_info.interaction_kwargs needs a 'name'"):
            generate(tokenizer, box, lambda turn: "x", [{"ground_truth": "5"}])
    finally:
        box.close()
    texts = [tokenizer.decode(batch.responses[i][batch.attended[i].bool()]) for i in range(2)]
    # the state lives in one worker across the turns; messages: prompt + (assistant, user) per turn
    assert "<|user|>u:w-2<|end|>" in texts[0] and "<|user|>u:w-2-4<|end|>" in texts[0]
    assert texts[0].count("<|assistant|>") == 2 and texts[0].endswith("a2" + tokenizer.eos_token)
    assert batch.extra_infos[0]["turn_scores"] == [0.25, 0.25] and batch.extra_infos[0]["num_turns"] == 6
    assert batch.extra_infos[1]["turn_scores"] == [0.0, 0.0]


@pytest.mark.parametrize("body, said", [
    ("raise RuntimeError('judge is down')", "interaction boom on row 0 (respond) raised RuntimeError: judge is down"),
    ("import os; os._exit(3)", "interaction boom on row 0 (respond) ended its worker process with exit status 3"),
])
def test_a_failing_interaction_is_one_line_and_ends_the_row(tmp_path, tokenizer, caplog, body, said):
    (tmp_path / "boomusers.py").write_text(textwrap.dedent(f'''
        from plait.agents.interactions import BaseInteraction

        class Boom(BaseInteraction):
            async def generate_response(self, instance_id, messages, **kwargs):
                {body}
    '''))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        box = box_for(tmp_path, "interaction:\n  - name: boom\n    class_name: boomusers.Boom\n", workers=1)
    finally:
        os.chdir(cwd)
    try:
        batch = generate(tokenizer, box, lambda turn: "hi", [{"name": "boom"}])
    finally:
        box.close()
    assert [r.getMessage() for r in caplog.records if "interaction boom" in r.getMessage()][0].startswith(said)
    assert batch.extra_infos[0]["num_turns"] == 3 and batch.extra_infos[0]["turn_scores"] == []
    assert int(batch.attended[0].sum()) == len("hi") + 1
    assert agent_metrics(batch)["agent_loop/interaction_error_rate"] == 1.0


def test_an_interactions_text_is_valid_unicode_and_bounded_by_the_budget(tmp_path, tokenizer):
    """A lone surrogate (the tokenizer raises on it) becomes U+FFFD; a 20 MiB answer is cut in its worker
    at 64 characters per token of the response budget, before it crosses to the trainer."""
    (tmp_path / "floodusers.py").write_text(textwrap.dedent('''
        from plait.agents.interactions import BaseInteraction

        class Flood(BaseInteraction):
            async def generate_response(self, instance_id, messages, **kwargs):
                if len(messages) < 4:
                    return False, "bad \\ud800 text", 0.5, {}
                return True, "z" * (20 << 20), 0.5, {}
    '''))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        box = box_for(tmp_path, "interaction:\n  - name: flood\n    class_name: floodusers.Flood\n", workers=1)
    finally:
        os.chdir(cwd)
    try:
        reply, error = asyncio.run(box.call("respond", "flood", "r1", {}, "row 0", messages=[{}] * 4, max_chars=100))
        assert error is None and reply["text"] == "z" * 100
        batch = generate(tokenizer, box, lambda turn: "hi", [{"name": "flood"}], response_length=60)
    finally:
        box.close()
    text = tokenizer.decode(batch.responses[0][batch.attended[0].bool()])
    assert "<|user|>bad \ufffd text<|end|>" in text and batch.extra_infos[0]["turn_scores"] == [0.5, 0.5]
    assert "<|user|>zzz" in text and text.endswith("zzz") and int(batch.attended[0].sum()) == 60  # cut at the budget


@pytest.mark.parametrize("text, match", [
    ("interaction: []\n", "non-empty list under 'interaction'"),
    ("interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
     "  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n", "two interactions are named 'gsm8k'"),
    ("interaction:\n  - class_name: nosuchpkg.Thing\n", "nosuchpkg, which is not installed"),
])
def test_bad_interaction_files_are_one_config_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as err:
        box_for(tmp_path, text, workers=1)
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


INTERACTION_VERL_YAML = (Path(__file__).resolve().parents[1] / "fixtures" / "verl_configs" / "gsm8k_multiturn_grpo_w_interaction.yaml").read_text()


def test_verls_gsm8k_interaction_command_line_runs(tmp_path):
    """verl's examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh (its config YAML,
    interaction YAML and keys; the tiny demo model, rows as verl's gsm8k_multiturn_w_interaction.py writes
    them plus agent_name=tool_agent, sizes shrunk, rollout.name=hf), sync: the interaction answers as the
    user, its scores reach the rows and plait's interaction metrics are logged."""
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_loop_e2e import REPO, verl_command

    from plait.data.tasks import make_task_rows
    from plait.trainers.lifecycle import read_metrics
    # a random model rarely ends a turn: a long budget lets some turns end (eos) and the user answer them
    cmd = [c.replace("data.max_response_length=24", "data.max_response_length=640")
           for c in verl_command(tmp_path) if "tool_config_path" not in c]
    (tmp_path / "config" / "gsm8k_multiturn_grpo.yaml").write_text(INTERACTION_VERL_YAML)
    (tmp_path / "gsm8k_interaction_config.yaml").write_text(
        'interaction:\n  - name: "gsm8k"\n    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
        "    config: {}\n")
    for split, n in (("train", 16), ("test", 4)):
        rows = [{"data_source": "openai/gsm8k", "agent_name": "tool_agent", "prompt": r["prompt"], "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": r["reward_model"]["ground_truth"]},
                 "extra_info": {"split": split, "index": r["extra_info"]["index"], "interaction_kwargs": {
                     "name": "gsm8k", "query": r["prompt"][-1]["content"],
                     "ground_truth": r["reward_model"]["ground_truth"]}}}
                for r in make_task_rows("arithmetic", split, n, seed=0)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")
    cmd.append("actor_rollout_ref.rollout.multi_turn.interaction_config_path="
               f"{tmp_path / 'gsm8k_interaction_config.yaml'}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "multi_turn" in line or "interaction " in line]
    assert not said, said  # no "no effect" notice, no failing interaction
    train = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "num_turns/mean" in r]
    assert len(train) == 2
    # the tiny random model never writes the right "#### N": the user answers every turn that ends
    assert max(r["agent_loop/interaction_turns_per_trajectory"] for r in train) > 0
    assert max(r["num_turns/max"] for r in train) >= 3
    assert all(r["agent_loop/interaction_error_rate"] == 0.0 for r in train)
