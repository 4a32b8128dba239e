"""verl 0.9.1's code reward on a SandboxFusion service (plait/data/sandbox_fusion.py), against a local
service started here (tests/data/sandbox_service.py: real subprocesses, real HTTP). Hand-computed
scores; the same responses scored by verl 0.9.1's own `default_compute_score` against the same service
side by side when PLAIT_VERL_SITE names verl installed aside (see tests/data/test_geo3k_reward.py);
and a `plait train` run with verl's `reward.sandbox_fusion.url` and codecontests rows."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.configtree import ConfigError
from plait.data import sandbox_fusion
from plait.data.rewards import RewardConfig, default_compute_score, has_builtin_reward
from plait.data.sandbox_fusion import compute_score, extract_code
from tests.data.sandbox_service import SandboxService

VERL_SITE = os.environ.get("PLAIT_VERL_SITE")


@pytest.fixture(scope="module")
def service():
    server = SandboxService(max_run_s=1.0, slow_s=3.0)
    yield server
    server.close()


def fence(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


ECHO_SUM = "a, b = map(int, input().split())\nprint(a + b)"
STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", "7\n", "0\n"]})
CALLS = json.dumps({"fn_name": "plus", "inputs": ["1\n2", "5\n6", "[1, 2]"], "outputs": ["3", "11", "[1, 2, 0]"]})
# (response, test cases, score): the score verl 0.9.1 gives, worked out by hand
CASES = [
    (fence(ECHO_SUM), STDIO, 1.0),                                      # right; trailing newlines ignored
    (fence("a, b = map(int, input().split())\nprint(a * b if a > 5 else a + b)"), STDIO, 0.75),  # wrong on 10 -3
    (fence("print(0)"), STDIO, 0.25),                                   # right only on 0 0
    (fence("raise SystemExit(3)"), STDIO, 0.0),                         # exits non-zero: a runtime error
    (fence("import sys\nprint(1)\nsys.exit(1)"), json.dumps({"inputs": ["x"], "outputs": ["1"]}), 0.0),
    (fence("while True:\n    pass"), STDIO, 0.0),                       # runs past the time limit
    (fence("def f(:\n    pass"), STDIO, 0.0),                           # a syntax error
    ("print(3)", STDIO, 0.0),                                           # no code block: not run at all
    ("```\nprint(7)\n```", json.dumps({"inputs": ["", ""], "outputs": ["7", "8"]}), 0.5),  # a bare fence
    ("```py\nprint(7)```", json.dumps({"inputs": [""], "outputs": ["7"]}), 1.0),  # its language word dropped
    ("```python\nprint(1)\n``` and ```python\nprint(2)\n```", json.dumps({"inputs": [""], "outputs": ["2"]}), 1.0),
    (fence("def plus(a, b):\n    return a + b"), CALLS, 2 / 3),         # call-based: args are JSON lines
    (fence("class Solution:\n    def plus(self, a, b=0):\n        return (a + [b]) if isinstance(a, list) else a + b"),
     CALLS, 1.0),                                                       # a method of Solution; a list prints as JSON
    (fence("class Solution:\n    def add(self, a, b=0):\n        return (a + [b]) if isinstance(a, list) else a + b"),
     CALLS.replace("plus", "add"), 2 / 3),  # verl's harness finds operator.add (star-imported) before Solution's
    (fence("def other(a, b):\n    return a + b"), CALLS, 0.0),          # no such function: nothing printed
    (fence("def add(a, b):\n    return sqrt(a * a) + b"), json.dumps({"fn_name": "add", "inputs": ["3\n4"],
                                                                         "outputs": ["7.0"]}), 1.0),  # math's names
    (fence("x = 1"), json.dumps({"assert_case": ["assert x == 1", "assert x == 2"]}), 0.5),  # assert-only cases
    (fence("print(input())"), {"inputs": [str(i) for i in range(12)], "outputs": [str(i) for i in range(11)] + ["?"]},
     1.0),                                                              # only the first 10 cases count
    (fence("print(1)"), json.dumps({"inputs": ["", ""], "outputs": ["1"]}), 0.0),  # inputs and outputs differ
    (fence("print(1)"), "{not json", 0.0),
    (fence("print(1)"), json.dumps({"inputs": [], "outputs": []}), 0.0),
    (fence("print(1)"), json.dumps({"outputs": ["1"]}), 0.0),
]


@pytest.mark.parametrize("response, cases, score", CASES)
def test_code_scores_by_hand(service, response, cases, score):
    assert default_compute_score("codecontests", response, cases, sandbox_fusion_url=service.url()) == \
        pytest.approx(score)


def test_the_request_is_sandbox_fusions(service):
    before = len(service.bodies)
    assert default_compute_score("apps", fence("print(input())"), {"inputs": ["hi"], "outputs": ["hi"]},
                                 sandbox_fusion_url=service.url(), memory_limit_mb=512) == 1.0
    body = service.bodies[before]
    assert body == {"compile_timeout": 10, "run_timeout": 10, "code": "\nprint(input())\n\n\n", "stdin": "hi",
                    "memory_limit_MB": 512, "language": "python", "files": {}, "fetch_files": []}


def test_a_batch_is_scored_side_by_side_within_max_concurrent(service):
    # 6 responses of 3 slow cases each: 2 responses at once (max_concurrent 12 / 10, rounded up), so more
    # than one response's requests are in flight, and at most 2 x 3; every score as the response deserves.
    from plait.configtree import build
    from plait.data.rewards import ScoreRequest, resolve_reward
    reward = build(RewardConfig, {"sandbox_fusion": {"url": service.url(), "max_concurrent": 12}}, "reward")
    score = resolve_reward(reward, 64)
    responses = [fence(f"import time\ntime.sleep(0.3)\nprint({k % 2})") for k in range(6)]
    truth = json.dumps({"inputs": ["", "", ""], "outputs": ["1", "1", "1"]})
    service.most_at_once = 0
    scores, _ = score(ScoreRequest(["taco"] * 6, responses, [truth] * 6, [None] * 6, [8] * 6))
    assert scores == [0.0, 1.0] * 3
    assert 3 < service.most_at_once <= 6


def test_a_compile_error_fails_the_cases_after_it(service):
    # Case 1's assert does not parse: the service's compile step fails it, and every case after it fails too.
    cases = {"assert_case": ["assert x == 1", "assert (", "assert x == 1"]}
    score, statuses = compute_score(service.url("/compiling"), fence("x = 1"), cases)
    assert statuses == ["success", "compile_error", "compile_error_skipped"] and score == pytest.approx(1 / 3)


def test_extract_code():
    assert extract_code("a ```python\nx\n``` b") == "\nx\n"
    assert extract_code("```Python3\nx```") == "Python3\nx"     # not only letters: the first line stays
    assert extract_code("no fence") is None


@pytest.mark.parametrize("path, status", [("/bad_json", "api_error"), ("/broken", "api_error")])
def test_a_service_that_answers_badly_scores_zero_with_a_warning(service, caplog, path, status):
    sandbox_fusion._warned.update(at=float("-inf"), unanswered=0)
    with caplog.at_level(logging.WARNING, logger="plait.data.sandbox_fusion"):
        score, statuses = compute_score(service.url(path), fence("print(1)"), {"inputs": [""], "outputs": ["1"]})
    assert (score, statuses) == (0.0, [status])
    assert [r.getMessage() for r in caplog.records][0].startswith(f"reward.sandbox_fusion.url={service.url(path)}: 1 ")


def test_a_gateway_timeout_is_tried_three_times(service):
    before = service.requests.get("/gateway", 0)
    assert compute_score(service.url("/gateway"), fence("print(1)"), {"inputs": [""], "outputs": ["1"]})[0] == 0.0
    assert service.requests["/gateway"] - before == 3


def test_a_service_that_is_down_or_slow_scores_zero(service, monkeypatch):
    down = SandboxService()
    url = down.url()
    down.close()  # nothing listens there now
    assert compute_score(url, fence("print(1)"), {"inputs": [""], "outputs": ["1"]}) == (0.0, ["api_error"])
    monkeypatch.setattr(sandbox_fusion, "API_SLACK_S", 0.5)  # the service sleeps 3 s: past 2 x 1 + 0.5
    assert compute_score(service.url("/slow"), fence("print(1)"), {"inputs": [""], "outputs": ["1"]}, timeout=1) \
        == (0.0, ["api_error"])


@pytest.mark.parametrize("key", ["sandbox_fusion", "reward_model.sandbox_fusion", "reward.sandbox_fusion"])
def test_verls_spellings_of_the_keys(key):
    from plait.config import load_config
    cfg = load_config(None, [f"{key}.url=https://sandbox.example/run_code", f"{key}.max_concurrent=128"])
    assert (cfg.reward.sandbox_fusion.url, cfg.reward.sandbox_fusion.max_concurrent) == \
        ("https://sandbox.example/run_code", 128)
    assert cfg.reward.sandbox_fusion.memory_limit_mb == 1024  # verl's default


def test_a_url_that_is_not_http_is_one_line_from_the_cli(capsys):
    from plait import cli
    assert cli.main(["config", "show", "reward.sandbox_fusion.url=localhost:8080/run_code"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith(
        "plait: config error: reward.sandbox_fusion.url='localhost:8080/run_code': an http:// or https:// address")


def test_prime_is_refused_saying_verl_has_none():
    from plait.config import load_config
    with pytest.raises(ConfigError, match="verl 0.9.1 has no prime manager either"):
        load_config(None, ["reward_model.reward_manager=prime"])


def test_code_sources_need_the_url():
    for source in ("codecontests", "apps", "codeforces", "taco"):
        assert not has_builtin_reward(source) and has_builtin_reward(source, "http://h/run_code")
        with pytest.raises(ValueError, match="reward.sandbox_fusion.url"):
            default_compute_score(source, fence("print(1)"), "{}")


@pytest.mark.parametrize("key, value, valid", [("url", "localhost:8080/run_code", "http:// or https://"),
                                               ("max_concurrent", 0, "> 0"), ("memory_limit_mb", -1, "> 0")])
def test_bad_sandbox_settings_are_one_config_line(key, value, valid):
    from plait.configtree import build
    with pytest.raises(ConfigError, match=valid) as err:
        build(RewardConfig, {"sandbox_fusion": {key: value}}, "reward")
    assert f"reward.sandbox_fusion.{key}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl").is_dir(),
                    reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")
def test_code_scores_equal_verl_091_side_by_side(service):
    cases = [(r, c if isinstance(c, str) else json.dumps(c)) for r, c, _ in CASES]
    compiling = [(fence("x = 1"), json.dumps({"assert_case": ["assert x == 1", "assert (", "assert x == 1"]}))]
    script = ("import json, sys\nfrom verl.utils.reward_score import default_compute_score as f\n"
              "url, compiling, cases = json.load(sys.stdin)\n"
              "print(json.dumps([f('codecontests', r, c, sandbox_fusion_url=u) for u, cs in ((url, cases), "
              "(compiling, %s)) for r, c in cs]))\n" % json.dumps(compiling))
    path = os.pathsep.join([VERL_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "VERL_LOGGING_LEVEL": "CRITICAL"}
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps([service.url(), service.url("/compiling"),
                         cases]), capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    verl = json.loads(out.strip().splitlines()[-1])
    plait = [default_compute_score("codecontests", r, c, sandbox_fusion_url=service.url()) for r, c in cases]
    plait += [default_compute_score("codecontests", r, c, sandbox_fusion_url=service.url("/compiling"))
              for r, c in compiling]
    differ = [(c, p, v) for c, p, v in zip(cases + compiling, plait, verl) if p != pytest.approx(v)]
    assert not differ, f"{len(differ)} of {len(verl)} scores differ from verl 0.9.1's: {differ[:5]}"
    assert {0.0, 0.5, 1.0} <= set(verl)


ANSWER = "```print(1)```"  # what the trained policy writes: a fenced program that prints 1


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model after supervised steps on ANSWER after each training prompt (the sandbox needs a fence to
    run anything; a fresh model never writes one)."""
    from plait.data.warmstart import train_and_save
    from plait.models import load_causal_lm, load_tokenizer
    tokenizer, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    examples = []
    for row in code_rows(8):
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    out = tmp_path_factory.mktemp("coder")
    return train_and_save(model, tokenizer, examples, steps=60, batch_size=8, lr=3e-3, seed=0, out_dir=out,
                          settings={})


def code_rows(n: int) -> list[dict]:
    """codecontests rows as verl's code data carry them: test cases as a JSON string of inputs and outputs."""
    return [{"data_source": "codecontests", "prompt": [{"role": "user", "content": f"Print {k % 2 + 1}."}],
             "ability": "code", "reward_model": {"style": "rule", "ground_truth": json.dumps(
                 {"inputs": ["", "\n"], "outputs": [str(k % 2 + 1), f"{k % 2 + 1}\n"]})},
             "extra_info": {"index": k}} for k in range(n)]


def train_on_code_rows(tmp_path, tiny_config, coder_dir: str, url: str) -> dict:
    """One sync step of `plait train` on codecontests rows with the corpus script's keys; the step's record."""
    import yaml
    from plait import cli
    from plait.configtree import to_dict
    paths = {}
    for split, n in (("train", 8), ("val", 4)):
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in code_rows(n)))
    cfg = tiny_config(tmp_path / "out", f"actor_rollout_ref.model.path={coder_dir}",
                      f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
                      "data.max_response_length=20", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                      "trainer.val_before_train=false", "algorithm.adv_estimator=grpo",
                      f"reward_model.sandbox_fusion.url={url}",  # the corpus script's spelling
                      "reward_model.sandbox_fusion.max_concurrent=128")
    assert cfg.reward.sandbox_fusion.url == url and cfg.reward.sandbox_fusion.max_concurrent == 128
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    assert cli.main(["train", "--no-progress", "--config", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if "actor/pg_loss" in r)


def test_plait_train_scores_codecontests_rows_on_the_service(tmp_path, tiny_config, service, coder_dir):
    before = service.requests.get("/run_code", 0)
    step = train_on_code_rows(tmp_path, tiny_config, coder_dir, service.url())
    assert service.requests["/run_code"] > before  # the responses' code ran on the service
    assert 0.0 < step["critic/score/mean"] < 1.0  # the rows that want 1 pass, the rows that want 2 do not


def test_plait_train_goes_on_when_the_service_fails(tmp_path, tiny_config, service, coder_dir, caplog):
    sandbox_fusion._warned.update(at=float("-inf"), unanswered=0)
    before = service.requests.get("/broken", 0)
    with caplog.at_level(logging.WARNING, logger="plait.data.sandbox_fusion"):
        step = train_on_code_rows(tmp_path, tiny_config, coder_dir, service.url("/broken"))
    assert service.requests["/broken"] > before and step["critic/score/mean"] == 0.0
    warned = [r.getMessage() for r in caplog.records if r.name == "plait.data.sandbox_fusion"]
    assert len(warned) == 1 and "got no answer (last: HTTP 500" in warned[0]  # once a minute at most


@pytest.mark.parametrize("path", ["/drip", "/drip_headers"])
def test_a_service_that_drips_its_answer_is_given_up_at_the_deadline(service, path):
    """A byte every 0.5 s never trips a per-read time-out: the request's deadline bounds the whole answer."""
    import time
    start = time.monotonic()
    answer, why = sandbox_fusion.post_run_code(service.url(path), {"code": "print(1)"}, timeout=1.5)
    assert answer is None and why == "TimeoutError: no whole answer within 1.5 s"
    assert time.monotonic() - start < 4


def test_code_rows_without_a_url_are_refused_at_start(tmp_path, tiny_config, capsys):
    import yaml
    from plait import cli
    from plait.configtree import to_dict
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in code_rows(2)))
    cfg = tiny_config(tmp_path / "out", f"data.train_files={path}", f"data.val_files={path}")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    assert cli.main(["train", "--no-progress", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'codecontests' (row 0) is scored by running its code" in err
    assert "reward.sandbox_fusion.url" in err
