"""Agent loops on a scripted engine: the engine answers each request from a script (the model's
turns as text), so ids, masks, log-probs, turn limits and the scheduler's rounds are checked
exactly. Tools are real (a function-tool file in a worker process)."""

import json
import threading
import time

import pytest
import torch

from plait.agents.loop import AgentLoopBase, AgentLoopOutput, register
from plait.agents.tokens import ContinuousTokens, PrefixUnstable
from plait.agents.tools import ToolBox, ToolLimits
from plait.agents.worker import AgentWorker
from plait.config import PlaitConfig, SamplingConfig
from plait.models import build_char_tokenizer
from plait.trainers.metrics import agent_metrics, loop_scores
from plait.types import PromptBatch
from plait.workers.rollout_engine import Generation

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
          "{% for c in m.get('tool_calls', []) %}[call {{ c['function']['name'] }}]{% endfor %}<|end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "add.py"
    path.write_text('from plait.agents.tools import function_tool\n\n\n@function_tool\ndef add(a: int, b: int) -> str:\n'
                    '    """Add two integers.\n\n    Args:\n        a: first\n        b: second\n    """\n'
                    '    return str(a + b), 0.5\n')
    from types import SimpleNamespace
    box = ToolBox.from_config(SimpleNamespace(tool_config_path=None, function_tool_path=str(path),
                                              max_tool_response_length=256, tool_response_truncate_side="middle"),
                              ToolLimits(num_workers=1))
    yield box
    box.close()


class ScriptedEngine:
    """engine_round for the scheduler: each request's next turn is script(text of the conversation so
    far), its log-prob -0.5 per token (a cut turn continues where it stopped); it records the size of
    every round."""

    def __init__(self, tokenizer, script, version=0):
        self.tok, self.script, self.rounds, self.version = tokenizer, script, [], version
        self.cut_after: int | None = None  # abort the next round after this many tokens per row

    def __call__(self, ids, max_new_tokens, sampling):
        self.rounds.append(len(ids))
        rows = []
        for p in ids:
            head, _, partial = self.tok.decode(p).rpartition("<|assistant|>")  # a resumed turn: its tokens so far
            text = self.script(head + "<|assistant|>")
            assert text.startswith(partial)
            text = text[len(partial):]
            rows.append(self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])
        width = max(1, max(len(r) for r in rows))
        out = torch.full((len(rows), width), self.tok.pad_token_id)
        mask = torch.zeros(len(rows), width)
        reasons = []
        for i, r in enumerate(rows):
            k = min(len(r), max_new_tokens, self.cut_after or 10 ** 9)
            out[i, :k], mask[i, :k] = torch.tensor(r[:k]), 1
            reasons.append("aborted" if self.cut_after is not None and k < min(len(r), max_new_tokens)
                           else "eos" if k == len(r) else "length")
        self.cut_after = None
        return Generation(out, mask, -0.5 * mask, reasons)


def config(response_length=200, **mt) -> PlaitConfig:
    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, response_length
    for k, v in mt.items():
        setattr(cfg.actor_rollout_ref.rollout.multi_turn, k, v)
    return cfg


def prompts(n_rows=1, agent_names=None) -> PromptBatch:
    raw = [[{"role": "user", "content": f"what is 2+3? ({i})"}] for i in range(n_rows)]
    return PromptBatch(prompt_ids=[[1]] * n_rows, data_sources=["t"] * n_rows, ground_truths=["5"] * n_rows,
                       extra_infos=[{"raw_prompt": r} for r in raw], indices=list(range(n_rows)),
                       agent_names=agent_names or [])


def run(tokenizer, tools, script, cfg=None, names=None, n_rows=1, default="tool_agent", engine=None):
    cfg = cfg or config()
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = default
    worker = AgentWorker(cfg, tokenizer, "qwen2", tools)
    engine = engine or ScriptedEngine(tokenizer, script)
    try:
        batch = worker.generate(prompts(n_rows, names), SamplingConfig(n=1), engine, lambda: engine.version)
    finally:
        worker.thread.close()
    return batch, engine


def tool_then_answer(text: str) -> str:
    return "#### 5" if "<|tool|>" in text else CALL


def test_tool_agent_ids_masks_and_logprobs(tokenizer, tools):
    batch, engine = run(tokenizer, tools, tool_then_answer)
    ct, eos = ContinuousTokens(tokenizer, "qwen2"), tokenizer.eos_token_id
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    turn1, turn2 = enc(CALL) + [eos], enc("#### 5") + [eos]
    tool = ct.delta([{"role": "tool", "content": "5"}], None)
    assert tokenizer.decode(tool) == "<|tool|>5<|end|>\n<|assistant|>"  # suffix diff + generation prompt
    n = batch.attended[0].sum().long().item()
    assert batch.responses[0, :n].tolist() == turn1 + tool + turn2  # assistant ids exactly as sampled
    assert batch.response_mask[0, :n].tolist() == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert batch.rollout_logprobs[0, :n].tolist() == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)
    assert batch.token_versions[0, :n].tolist() == [0] * len(turn1) + [-1] * len(tool) + [0] * len(turn2)
    assert tokenizer.decode(batch.prompts[0][batch.prompt_mask[0].bool()]) == "<|user|>what is 2+3? (0)<|end|>\n<|assistant|>"
    info, extra = batch.agent_infos[0], batch.extra_infos[0]
    assert info["num_turns"] == 4 and extra["tool_rewards"] == [0.5] and extra["num_turns"] == 4
    assert engine.rounds == [1, 1] and batch.stop_reasons == ["eos"]


def test_tool_calls_are_timeline_spans(tokenizer, tools, tmp_path):
    from plait.profiler.timeline import TIMELINE, read_timeline
    from plait.trainers.metrics import record_tool_spans
    batch, _ = run(tokenizer, tools, tool_then_answer)
    TIMELINE.open(str(tmp_path / "timeline.jsonl"))
    try:
        record_tool_spans(batch)
    finally:
        TIMELINE.close(1)
    [span] = read_timeline(str(tmp_path / "timeline.jsonl"))
    assert (span["role"], span["stage"], span["step"]) == ("rollout", "tool_calls", 1)
    assert 0 < span["end"] - span["start"] <= batch.agent_infos[0]["tool_calls"] + 0.01


def test_each_turn_and_tool_call_is_a_sample_span(tokenizer, tools, tmp_path):
    """The agent loop appends its per-turn spans to the row's info (profiler/samples.py add_span); the trainer
    writes them to samples.jsonl under the row's sample id."""
    from plait.profiler.samples import SampleLog
    batch, _ = run(tokenizer, tools, tool_then_answer)
    spans = batch.agent_infos[0]["sample_spans"]
    assert [(name, attrs["turn"]) for name, _, _, attrs in spans] == [("gen", 1), ("tool", 1), ("gen", 2)]
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:])) and spans[1][3]["calls"] == 1  # one after the other
    log = SampleLog()
    log.open(str(tmp_path / "samples.jsonl"))
    log.from_infos(["0.0.0"], batch.agent_infos)
    log.flush(1)
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(r["sample"], r["span"], r["attrs"]["turn"]) for r in rows] == [("0.0.0", "gen", 1), ("0.0.0", "tool", 1),
                                                                            ("0.0.0", "gen", 2)]


def test_turn_limits(tokenizer, tools):
    always_call = lambda text: CALL  # noqa: E731
    batch, _ = run(tokenizer, tools, always_call, config(max_assistant_turns=2))
    assert batch.agent_infos[0]["num_turns"] == 4  # 2 assistant + 1 tool answer + 1
    batch, _ = run(tokenizer, tools, always_call, config(max_user_turns=1))
    assert batch.agent_infos[0]["num_turns"] == 4
    batch, _ = run(tokenizer, tools, always_call, config())  # only the response budget stops it: the next
    n = int(batch.attended[0].sum())  # tool message would not fit (verl then ends without it)
    assert 200 - (len(CALL) + 1) - 30 < n <= 200 and batch.response_mask[0, n - 1] == 1


def test_parallel_calls_unknown_tool_and_bad_json(tokenizer, tools):
    two = CALL + '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": 7}</tool_call>'
    seen = []

    def script(text):
        seen.append(text)
        return two if "<|tool|>" not in text else "done"
    run(tokenizer, tools, script, config(400, max_parallel_calls=2))
    assert seen[-1].count("<|tool|>") == 2  # max_parallel_calls: the first two calls only
    assert "<|tool|>5<|end|>" in seen[-1] and "Unknown function 'nope'. Available tools: ['add']" in seen[-1]
    seen.clear()
    run(tokenizer, tools, script, config(400, max_parallel_calls=3))
    assert seen[-1].count("<|tool|>") == 3  # the third's arguments are not an object: verl's error text
    assert "Error executing tool 'add'" in seen[-1] or "Invalid" in seen[-1] or "add()" in seen[-1]


def test_a_tool_message_that_does_not_fit_ends_the_trajectory(tokenizer, tools):
    cfg = config()
    cfg.data.max_response_length = len(CALL) + 3  # the call fits, the tool message does not
    batch, _ = run(tokenizer, tools, tool_then_answer, cfg)
    assert batch.response_mask[0].tolist() == [1.0] * (len(CALL) + 1) + [0.0] * (batch.responses.shape[1] - len(CALL) - 1)
    assert batch.agent_infos[0]["num_turns"] == 2


def test_prefix_stability_check(tokenizer):
    unstable = build_char_tokenizer()
    unstable.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(PrefixUnstable, match="prefix-stable"):
        ContinuousTokens(unstable, "llama").delta([{"role": "user", "content": "again"}], None)


def test_agent_name_per_row_default_and_unknown(tokenizer, tools):
    batch, _ = run(tokenizer, tools, tool_then_answer, names=["single_turn_agent", None], n_rows=2)
    assert [i["num_turns"] for i in batch.agent_infos] == [2, 4]  # row 1 takes the default (tool_agent)
    assert (batch.response_mask[0] == batch.attended[0]).all()
    with pytest.raises(ValueError, match="'nope' is not a registered agent loop"):
        run(tokenizer, tools, tool_then_answer, names=["nope"])


@register("scored_echo")
class ScoredEcho(AgentLoopBase):
    """A user loop: one turn, scores itself (reward_score overrides the reward function)."""

    def __init__(self, *args, bonus: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.bonus = bonus

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        ids = await self.ct_build_initial_tokens(kwargs["raw_prompt"])
        out = await self.server_manager.generate(request_id="x", prompt_ids=ids, sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               response_logprobs=out.log_probs, reward_score=1.0 + self.bonus, num_turns=2)


def test_user_loop_from_yaml_with_kwargs_and_its_reward_score(tokenizer, tools, tmp_path):
    path = tmp_path / "loops.yaml"
    path.write_text(f"- name: mine\n  _target_: {__name__}.ScoredEcho\n  bonus: 2.5\n")
    cfg = config()
    cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(path)
    batch, _ = run(tokenizer, tools, lambda t: "hi", cfg, names=["mine", "single_turn_agent"], n_rows=2)
    assert loop_scores(batch, [0.0, 0.25]) == [3.5, 0.25]
    assert batch.attended[0].sum() == 3  # "hi" + EOS: no max_tokens given, the response length bounds it
    metrics = agent_metrics(batch)
    assert metrics["num_turns/max"] == 2 and "agent_loop/slowest/response_length" in metrics


def test_scheduler_batches_trajectories_at_different_speeds(tokenizer, tools):
    """Four rows: two call the tool first, two answer at once; the first round batches all four."""
    def script(text):
        slow = text.count("(0)") or text.count("(1)")
        return CALL if slow and "<|tool|>" not in text else "#### 5"
    batch, engine = run(tokenizer, tools, script, n_rows=4)
    assert engine.rounds == [4, 2]
    assert [i["num_turns"] for i in batch.agent_infos] == [4, 4, 2, 2]


def test_abort_inside_a_turn_resumes_with_new_weights_and_versions(tokenizer, tools):
    """A weight sync cuts turn 1 after 5 tokens: generate returns the row aborted; resume finishes it
    with version 1, and each token keeps the version that sampled it."""
    cfg = config()
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    worker = AgentWorker(cfg, tokenizer, "qwen2", tools)
    engine = ScriptedEngine(tokenizer, tool_then_answer)
    engine.cut_after = 5
    try:
        first = worker.generate(prompts(), SamplingConfig(n=1), engine, lambda: engine.version)
        assert first.stop_reasons == ["aborted"]
        engine.version = 1
        batch = worker.resume(first, engine, lambda: engine.version)
    finally:
        worker.thread.close()
    n = batch.attended[0].sum().long().item()
    versions = batch.token_versions[0, :n].tolist()
    turn1 = len(CALL) + 1
    assert versions[:5] == [0] * 5 and versions[5:turn1] == [1] * (turn1 - 5)
    assert batch.stop_reasons == ["eos"] and batch.versions.tolist() == [1]
    text = tokenizer.decode(batch.responses[0, :n])
    assert text.startswith(CALL) and text.endswith("#### 5<eos>".replace("<eos>", tokenizer.eos_token))


def test_an_abort_that_lands_as_the_last_trajectory_ends_leaves_nothing_to_resume(tokenizer, tools, monkeypatch):
    """A weight sync's abort seen just as a rollout's last trajectory ended: the rollout is whole (no aborted
    row, so the trainer never resumes it) and nothing stays suspended: the next rollout may be cut and resumed.
    (It stayed suspended, and the next cut raised 'a rollout was cut short while another one waited to resume'.)"""
    import plait.agents.worker as agent_worker
    whole = agent_worker.drive

    def abort_seen_at_the_end(run, *args):
        whole(run, *args)  # every trajectory runs to its end ...
        return True        # ... and the abort is seen as the last one ends
    cfg = config()
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    worker = AgentWorker(cfg, tokenizer, "qwen2", tools)
    engine = ScriptedEngine(tokenizer, tool_then_answer)
    try:
        monkeypatch.setattr(agent_worker, "drive", abort_seen_at_the_end)
        first = worker.generate(prompts(2), SamplingConfig(n=1), engine, lambda: engine.version)
        assert first.stop_reasons == ["eos", "eos"] and worker.suspended is None
        monkeypatch.setattr(agent_worker, "drive", whole)
        engine.cut_after = 5
        second = worker.generate(prompts(2), SamplingConfig(n=1), engine, lambda: engine.version)
        assert second.stop_reasons == ["aborted", "aborted"]
        assert worker.resume(second, engine, lambda: engine.version).stop_reasons == ["eos", "eos"]
    finally:
        worker.thread.close()


def test_rollout_worker_cut_by_a_weight_sync_resumes_on_the_new_weights(tmp_path, tokenizer):
    """The real engine: a sync aborts a rollout mid-turn; resume finishes it with the loaded weights
    (version 1) and its tokens carry the version that sampled each."""
    from plait.models import create_tiny_model, load_causal_lm
    from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
    from plait.workers.rollout import Rollout
    path = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    cfg = config(40)
    cfg.actor_rollout_ref.rollout.multi_turn.enable = True
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    rollout = Rollout(path, 40, tokenizer, profiler, ignore_eos=True, agent_cfg=cfg)
    started, generate = threading.Event(), rollout.engine.generate

    def flagged(*args, on_forward=None, **kwargs):
        started.set()

        def slowly(i):  # each decode step takes a while, so the abort lands mid-turn
            time.sleep(0.01)
            if on_forward is not None:
                on_forward(i)
        return generate(*args, on_forward=slowly, **kwargs)
    rollout.engine.generate = flagged
    out = {}
    worker = threading.Thread(target=lambda: out.update(b=rollout.generate(prompts(2), SamplingConfig(n=1), seed=3)))
    worker.start()
    assert started.wait(30)
    time.sleep(0.05)
    rollout.abort()
    worker.join(30)
    assert out["b"].stop_reasons == ["aborted", "aborted"]
    state = {k: v + 0.01 for k, v in load_causal_lm(path).state_dict().items()}
    rollout.load_weights(state, version=1)
    batch = rollout.resume(out["b"], SamplingConfig(n=1), seed=4)
    rollout.close()
    assert batch.stop_reasons == ["length", "length"] and (batch.attended.sum(-1) == 40).all()
    for row in batch.token_versions.tolist():
        assert row[0] == 0 and row[-1] == 1 and row == sorted(row)  # version 0 first, then 1


class ScriptedStream(ScriptedEngine):
    """A continuous-batching engine (vLLM's `serve` contract): one token per live request per step;
    requests join at the next step. Records (step, row text tail) of each admission."""

    def serve(self, admit, deliver, stop):
        live, step, self.admitted = [], 0, []
        while True:
            for key, ids, sampling, budget in admit():
                head, _, partial = self.tok.decode(ids).rpartition("<|assistant|>")
                text = self.script(head + "<|assistant|>")[len(partial):]
                live.append([key, self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id], [], budget])
                self.admitted.append((step, self.tok.decode(ids)[-12:]))
            if not live:
                if stop():
                    return False
                time.sleep(0.002)
                continue
            step += 1
            time.sleep(0.005)  # a decode step takes time: tools answer meanwhile
            for item in list(live):
                key, todo, done, budget = item
                done.append(todo.pop(0))
                if not todo or len(done) >= budget:
                    live.remove(item)
                    deliver(key, done, [-0.5] * len(done), "eos" if not todo else "length")


def test_continuous_batching_admits_a_next_turn_while_others_decode(tokenizer, tools):
    """Row 0 calls the tool at once and answers briefly; row 1 writes a long first turn. Row 0's second
    turn joins the running batch long before row 1's first turn ends."""
    def script(text):
        if "(1)" in text:
            return "x" * 150
        return "#### 5" if "<|tool|>" in text else CALL
    engine = ScriptedStream(tokenizer, script)

    def engine_round(*args):
        raise AssertionError("a continuous engine is served, not run in rounds")
    engine_round.serve = engine.serve
    cfg = config(400)
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    worker = AgentWorker(cfg, tokenizer, "qwen2", tools)
    try:
        batch = worker.generate(prompts(2), SamplingConfig(n=1), engine_round, lambda: 0)
    finally:
        worker.thread.close()
    assert len(engine.admitted) == 3 and 0 < engine.admitted[-1][0] < 150
    assert [i["num_turns"] for i in batch.agent_infos] == [4, 2] and batch.attended[1].sum() == 151


def test_unknown_loops_and_targets_are_config_errors(tmp_path):
    from plait.agents.worker import check_agent_names, resolve_class
    from plait.configtree import ConfigError
    with pytest.raises(ConfigError, match="default_agent_loop='nope'"):
        check_agent_names(None, "nope", set())
    with pytest.raises(ConfigError, match="^agent_name='other'"):
        check_agent_names(None, "single_turn_agent", {"tool_agent", "other"})
    (tmp_path / "verl_loop.py").write_text("from verl.experimental.agent_loop import AgentLoopBase, register\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="from plait.agents.loop import AgentLoopBase, register"):
            resolve_class("verl_loop.Mine")
    finally:
        sys.path.remove(str(tmp_path))


def test_verls_ct_merge_methods_for_user_loops(tokenizer):
    """A loop written against verl's AgentLoopBase merges turns with ct_merge_*: same ids and masks as
    tool_agent's bookkeeping."""
    import asyncio
    loop = ScoredEcho(__import__("plait.agents.loop", fromlist=["ConfigWrap"]).ConfigWrap(config()), None, tokenizer)
    messages = [{"role": "user", "content": "q"}]
    ids = asyncio.run(loop.ct_build_initial_tokens(messages))
    merged, mask, lps = asyncio.run(loop.ct_merge_assistant_token(ids, [70, 71], [], [], [-0.1, -0.2]))
    updated = [*messages, {"role": "assistant", "content": "FG"}, {"role": "tool", "content": "7"}]
    merged2, mask2, lps2 = asyncio.run(loop.ct_merge_context_msg(messages + updated[1:2], updated, merged.token_ids, mask, lps))
    tool = ContinuousTokens(tokenizer, "qwen2").delta([{"role": "tool", "content": "7"}], None)
    assert merged2.token_ids == ids + [70, 71] + tool and mask2 == [1, 1] + [0] * len(tool)
    assert lps2 == [-0.1, -0.2] + [0.0] * len(tool) and merged2.appended_token_count == len(tool)


def test_tool_call_and_valid_call_rates(tokenizer, tools):
    """Four rows: a malformed call (written, never parsed), a good call, a call of an unknown tool (parsed,
    failed), no call. Three of four wrote a call; one of the three calls parsed and ran."""
    turns = {"(0)": "<tool_call>{not json</tool_call>", "(1)": CALL,
             "(2)": '<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>', "(3)": "#### 5"}

    def script(text):
        return "#### 5" if "<|tool|>" in text else next(v for k, v in turns.items() if k in text)
    batch, _ = run(tokenizer, tools, script, n_rows=4)
    assert [i["tool_call_attempts"] for i in batch.agent_infos] == [1, 1, 1, 0]
    metrics = agent_metrics(batch)
    assert metrics["agent_loop/tool_call_rate"] == 0.75 and metrics["agent_loop/valid_call_rate"] == pytest.approx(1 / 3)
