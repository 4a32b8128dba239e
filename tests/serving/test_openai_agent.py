"""The openai_agent loop: outside agents (a function in worker processes, a command per row) drive rows through
the gateway with the `openai` SDK; what they sample is a batch of trajectories; each failure costs one sample."""

import collections
import os
import sys
import textwrap
import time

import pytest
import torch

from gateway_helpers import CALL, Scripted, tool_then_answer
from plait.agents.openai_agent import LINE_CHARS, LOGGED_PER_SESSION, SHOWN_PER_STEP, AgentOutput
from plait.agents.worker import AgentWorker
from plait.config import PlaitConfig, SamplingConfig
from plait.errors import RunError
from plait.trainers.metrics import loop_scores, session_advantages, session_metrics, session_owners
from plait.types import PromptBatch

AGENT = '''
import json, os, sys, time
import openai

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


async def run(row, base_url, api_key):
    {body}
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = list(row["messages"])
    for _ in range(3):
        r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for c in message.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return 1.0 if message.content.endswith(row["ground_truth"]) else 0.0
'''


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output dir, where agents.log goes, is relative: here, not in the repo


def agent_file(tmp_path, body="pass", name="agent.py"):
    path = tmp_path / name
    path.write_text(AGENT.replace("{body}", textwrap.indent(textwrap.dedent(body), "    ").strip()))
    return str(path)


def cfg_for(**agent) -> PlaitConfig:
    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 200
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "openai_agent"
    for key, value in agent.items():
        setattr(cfg.actor_rollout_ref.rollout.agent.openai_agent, key, value)
    return cfg


def prompts(n_rows: int) -> PromptBatch:
    raw = [[{"role": "user", "content": f"what is 2+3? ({i})"}] for i in range(n_rows)]
    return PromptBatch(prompt_ids=[[1]] * n_rows, data_sources=["t"] * n_rows, ground_truths=["5"] * n_rows,
                       extra_infos=[{"raw_prompt": r} for r in raw], indices=list(range(n_rows)))


def generate(tokenizer, cfg, n_rows=2, n=2, script=tool_then_answer, engine=None):
    worker = AgentWorker(cfg, tokenizer, "qwen2")
    engine = engine or Scripted(tokenizer, script)
    try:
        return worker.generate(prompts(n_rows), SamplingConfig(n=n), engine, lambda: engine.version)
    finally:
        worker.close()


def test_a_function_agent_on_the_openai_sdk_makes_the_batch(tokenizer, tmp_path):
    batch = generate(tokenizer, cfg_for(path=agent_file(tmp_path)))
    call = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(batch) == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    for i, info in enumerate(batch.agent_infos):
        assert info["reward_score"] == 1.0 and info["session"]["failure"] is None and info["session"]["requests"] == 2
        sampled = batch.response_mask[i].bool()
        assert batch.responses[i, :len(call)].tolist() == call and sampled[:len(call)].all()
        assert int(sampled.sum()) == len(call) + len("#### 5") + 1 < int(batch.attended[i].sum())
        assert (batch.rollout_logprobs[i][sampled] == -0.5).all() and (batch.token_versions[i][sampled] == 0).all()
    assert len({i["session"]["id"] for i in batch.agent_infos}) == 4


DEFAULT_CLIENT = """
import asyncio
from agents import Agent, Runner, set_default_openai_api, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
set_default_openai_api("chat_completions")


async def run(row, base_url, api_key):
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=api_key))  # process-wide: the last one wins
    await asyncio.sleep(0.2)  # every session has set its client before any calls the model
    await Runner.run(Agent(name="a", instructions="Answer.", model="plait"), row["messages"][-1]["content"])
"""


def test_a_process_wide_client_trains_each_call_in_its_own_session(tokenizer, tmp_path):
    """openai-agents' set_default_openai_client in the function form (one worker, four sessions): each session's
    chain is its own row's conversation."""
    pytest.importorskip("agents")
    (tmp_path / "agent.py").write_text(DEFAULT_CLIENT)
    batch = generate(tokenizer, cfg_for(path=str(tmp_path / "agent.py"), num_workers=1), script=lambda text: "#### 5")
    assert len(batch) == 4 and all(i["session"]["failure"] is None and i["session"]["requests"] == 1
                                   for i in batch.agent_infos)
    for row, group in zip(batch.prompts, batch.group_ids.tolist()):
        assert f"? ({group})" in tokenizer.decode(row[row != tokenizer.pad_token_id])


def test_an_unreadable_tool_call_reaches_the_agent_as_text_and_is_counted(tokenizer, tmp_path):
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call> so 5'
    batch = generate(tokenizer, cfg_for(path=agent_file(tmp_path)), script=lambda text: broken)
    assert [i["reward_score"] for i in batch.agent_infos] == [1.0] * 4  # the agent read the text, ending with "5"
    assert session_metrics(batch.agent_infos)["agent/unparsed_tool_calls"] == 4


CHATTY = "for k in range(30):\n    print(f'step {k} of row {row[\"index\"]}', file=(sys.stdout, sys.stderr)[k % 2])\n"


@pytest.mark.parametrize("form", ["function", "command"])
def test_what_agents_print_reaches_stderr_per_session_bounded_and_agents_log(tokenizer, tmp_path, capfd, form):
    if form == "function":
        cfg = cfg_for(path=agent_file(tmp_path, CHATTY))
    else:
        script = tmp_path / "agent_cli.py"
        script.write_text("import json, sys, openai\nrow = json.loads(sys.stdin.readline())\n" + CHATTY +
                          "openai.OpenAI().chat.completions.create(model='m', messages=row['messages'])\n")
        cfg = cfg_for(command=f"{sys.executable} {script}")
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    generate(tokenizer, cfg, script=lambda text: "#### 5")
    time.sleep(0.2)  # end_step runs on the agents' loop thread
    err = capfd.readouterr().err
    shown = [line for line in err.splitlines() if line.startswith("[agent row ")]
    sessions = collections.Counter(line[len("[agent "):].split("] ", 1)[0] for line in shown)
    assert len(sessions) == 4 and set(sessions.values()) == {20}  # "row 1/3fa2b1": a row's n samples apart
    assert all(f"] step " in line and line.endswith(f"of row {line[len('[agent row '):].split('/')[0]}") for line in shown)
    assert "the agents printed 40 more lines than shown" in err
    logged = (tmp_path / "run" / "agents.log").read_text().splitlines()
    assert collections.Counter(line.split(": ", 1)[0] for line in logged) == {label: 30 for label in sessions}


def test_agent_output_is_bounded_per_step_and_per_session_in_the_log(tmp_path, capsys):
    out = AgentOutput(str(tmp_path / "agents.log"))
    for k in range(300):  # 30 sessions of 10 lines: more than a step shows
        out.line(f"row {k % 30}/s", "x" * (LINE_CHARS + 10))
    for _ in range(LOGGED_PER_SESSION):  # one session past what the log keeps
        out.line("row 0/s", "y")
    out.end_step()
    err = capsys.readouterr().err
    assert err.count("[agent row") == SHOWN_PER_STEP and f"{300 + LOGGED_PER_SESSION - SHOWN_PER_STEP} more lines" in err
    logged = (tmp_path / "agents.log").read_text().splitlines()
    assert sum(line.startswith("row 0/s") for line in logged) == LOGGED_PER_SESSION
    assert logged[-1].endswith("[its later lines are not logged: 2000 a session]")
    assert max(len(line) for line in logged) < LINE_CHARS + 60
    out.close()


def test_a_command_agent_reads_its_row_and_posts_its_reward(tokenizer, tmp_path):
    script = tmp_path / "agent_cli.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys
        import openai, requests
        row = json.loads(sys.stdin.readline())
        client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        r = client.chat.completions.create(model=os.environ["PLAIT_MODEL"], messages=row["messages"])
        requests.post(os.environ["PLAIT_REWARD_URL"], json={"reward": 0.25 + row["index"]})
    '''))
    batch = generate(tokenizer, cfg_for(command=f"{sys.executable} {script}"), script=lambda text: "#### 5")
    assert [i["reward_score"] for i in batch.agent_infos] == [0.25, 0.25, 1.25, 1.25]
    assert all(i["session"]["failure"] is None for i in batch.agent_infos)


def test_each_failure_costs_its_own_sample(tokenizer, tmp_path):
    """Row 0 raises, row 1 outlives its timeout, row 2 never calls the model, row 3 is fine: three samples are
    masked out, named, and the batch goes on."""
    body = '''
    if row["index"] == 0:
        raise ValueError("bad arithmetic")
    if row["index"] == 1:
        import asyncio
        await asyncio.sleep(30)
    if row["index"] == 2:
        return 1.0
    '''
    batch = generate(tokenizer, cfg_for(path=agent_file(tmp_path, body), timeout=3), n_rows=4, n=1)
    failures = [i["session"]["failure"] for i in batch.agent_infos]
    assert "(row 0) raised ValueError: bad arithmetic" in failures[0]
    assert "(row 1) did not return within its timeout (3 s)" in failures[1]
    assert "(row 2) never called the model" in failures[2] and failures[3] is None
    assert batch.response_mask[:3].sum() == 0 and batch.response_mask[3].sum() > 0


def test_a_command_that_fails_and_a_batch_where_every_session_fails(tokenizer, tmp_path):
    cfg = cfg_for(command=f"{sys.executable} -c \"import sys; print('no key found', file=sys.stderr); sys.exit(3)\"")
    with pytest.raises(RunError, match=r"every agent session of the batch failed \(4\); the first: agent .* \(row 0\) "
                                       r"exited with status 3: no key found"):
        generate(tokenizer, cfg)


LEAVE_A_DAEMON = """
import os, subprocess, sys
pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True).pid
open(sys.argv[1], "a").write(str(pid) + chr(10))
"""


@pytest.mark.parametrize("form", ["command", "function"])
def test_what_an_agent_starts_ends_with_it(tokenizer, tmp_path, form):
    """An agent that leaves a daemon in a session of its own (setsid): gone once the rollout is over."""
    pids = tmp_path / "pids"
    (tmp_path / "daemon.py").write_text(LEAVE_A_DAEMON)
    leave = f"subprocess.run([sys.executable, {str(tmp_path / 'daemon.py')!r}, {str(pids)!r}], check=True)"
    (tmp_path / "cli.py").write_text(f"import json, os, subprocess, sys, openai\n{leave}\nrow = json.loads(sys.stdin.readline())\n"
                                     "openai.OpenAI().chat.completions.create(model='m', messages=row['messages'])\n")
    cfg = (cfg_for(command=f"{sys.executable} {tmp_path / 'cli.py'}") if form == "command" else
           cfg_for(path=agent_file(tmp_path, f"import subprocess, sys\n{leave}")))
    generate(tokenizer, cfg, n_rows=1, n=2)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.time() + 10
    while any(alive(p) for p in started) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in started)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_agent_worker_fails_its_sessions_and_is_replaced(tokenizer, tmp_path):
    marker = tmp_path / "died"
    body = f'''
    if not os.path.exists({str(marker)!r}):
        open({str(marker)!r}, "w").close()
        os._exit(7)
    '''
    cfg = cfg_for(path=agent_file(tmp_path, body), num_workers=1)
    worker = AgentWorker(cfg, tokenizer, "qwen2")
    engine = Scripted(tokenizer, tool_then_answer)
    try:
        with pytest.raises(RunError, match="its worker process exited with status 7"):
            worker.generate(prompts(1), SamplingConfig(n=2), engine, lambda: 0)
        batch = worker.generate(prompts(1), SamplingConfig(n=2), engine, lambda: 0)
    finally:
        worker.close()
    assert [i["reward_score"] for i in batch.agent_infos] == [1.0, 1.0]


def test_a_weight_sync_mid_decode_holds_the_call_and_records_each_tokens_version(tokenizer, tmp_path):
    """A sync cuts the first turn after 5 tokens: the agent's HTTP call is held (not answered, not refused)
    until resume, which finishes it with version 1; every token keeps the version that sampled it."""
    cfg = cfg_for(path=agent_file(tmp_path))
    worker = AgentWorker(cfg, tokenizer, "qwen2")
    engine = Scripted(tokenizer, tool_then_answer)
    engine.cut_after = 5
    try:
        first = worker.generate(prompts(1), SamplingConfig(n=1), engine, lambda: engine.version)
        assert first.stop_reasons == ["aborted"]
        engine.version = 1
        batch = worker.resume(first, engine, lambda: engine.version)
    finally:
        worker.close()
    sampled = batch.response_mask[0].bool()
    versions = batch.token_versions[0][sampled].tolist()
    assert versions == [0] * 5 + [1] * (len(versions) - 5) and batch.agent_infos[0]["reward_score"] == 1.0
    n = int(batch.attended[0].sum())
    assert tokenizer.decode(batch.responses[0, :n]).startswith(CALL)


def test_the_first_round_waits_for_every_agents_first_call(tokenizer, tmp_path):
    """Outside agents start at their own pace (here up to 0.2 s apart): the batch's first engine round still holds
    every session's first call, as it holds every in-process loop's."""
    body = "import asyncio\nawait asyncio.sleep(0.05 * row['index'])"
    engine = Scripted(tokenizer, tool_then_answer)
    generate(tokenizer, cfg_for(path=agent_file(tmp_path, body)), n_rows=5, n=1, engine=engine)
    assert engine.rounds[0] == 5


def test_a_validation_between_the_cut_and_the_resume_leaves_the_cut_rollout_to_resume(tokenizer, tmp_path):
    """fully_async: a sync cuts the rollouter's batch; validation generates on the same worker before the
    rollouter resumes. The cut batch still resumes (it was lost, and the rollouter spun on it, before)."""
    worker = AgentWorker(cfg_for(path=agent_file(tmp_path)), tokenizer, "qwen2")
    engine = Scripted(tokenizer, tool_then_answer)
    engine.cut_after = 5
    try:
        first = worker.generate(prompts(1), SamplingConfig(n=1), engine, lambda: engine.version)
        engine.version = 1
        validation = worker.generate(prompts(2), SamplingConfig(n=1), engine, lambda: engine.version)
        batch = worker.resume(first, engine, lambda: engine.version)
    finally:
        worker.close()
    assert first.stop_reasons == ["aborted"] and validation.stop_reasons == ["eos", "eos"]
    assert batch.stop_reasons == ["eos"] and batch.agent_infos[0]["reward_score"] == 1.0


def test_chains_share_their_sessions_score_and_advantage():
    """Rows: session A's first chain and final chain, failed session B, C, all of one prompt. GRPO sees A, C
    once each; both of A's chains take A's advantage; B's rows none."""
    def info(sid, final, failure=None, reward=None):
        return {"reward_score": reward, "session": {"id": sid, "final": final, "failure": failure}}
    infos = [info("a", False), info("a", True), info("b", True, failure="raised"), info("c", True)]
    batch = type("B", (), {"agent_infos": infos})
    assert loop_scores(batch, [0.0, 1.0, 0.5, 0.0]) == [1.0, 1.0, 0.5, 0.0]
    owner = session_owners(infos)
    assert owner.tolist() == [1, 1, -1, 3]
    mask = torch.tensor([[1., 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
    rewards = torch.zeros(4, 3)
    rewards[1, 2], rewards[3, 0] = 1.0, 0.0
    batch = type("B", (), {"token_rewards": rewards, "response_mask": mask, "group_ids": torch.zeros(4, dtype=torch.long)})
    adv = session_advantages("grpo", batch, owner, norm_by_std=False)
    assert torch.equal(adv, torch.tensor([[.5, .5, 0], [.5, .5, .5], [0, 0, 0], [-.5, 0, 0]]))


RAISES_ON_A_CUT = '''
async def run(row, base_url, api_key):
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    r = await client.chat.completions.create(model="m", messages=row["messages"], max_tokens=row["index"] * 50 or None)
    if r.choices[0].finish_reason == "length":
        raise RuntimeError("the answer was cut")  # as openai-agents does on an incomplete Response
    return 1.0
'''


def test_an_agent_that_fails_on_a_cut_by_the_response_budget_is_a_truncated_sample(tokenizer, tmp_path):
    """Row 0's answer is cut by the chain's response budget (the episode is over: trained as truncated, scored by
    the reward function); row 1 asked for 50 tokens itself and failed on that cut: its failure is its own."""
    (tmp_path / "agent.py").write_text(RAISES_ON_A_CUT)
    batch = generate(tokenizer, cfg_for(path=str(tmp_path / "agent.py")), n_rows=2, n=1, script=lambda text: "x" * 300)
    first, second = (i["session"] for i in batch.agent_infos)
    assert first["failure"] is None and "raised RuntimeError: the answer was cut" in first["failed_after_cut"]
    assert batch.response_mask[0].sum() == 200 and batch.agent_infos[0]["reward_score"] is None  # the reward function's
    assert "raised RuntimeError: the answer was cut" in second["failure"] and second["failed_after_cut"] is None
    assert batch.response_mask[1].sum() == 0
    assert session_metrics(batch.agent_infos)["agent/failed_after_cut"] == 1
