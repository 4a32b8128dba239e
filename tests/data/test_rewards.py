import math

import pytest

from plait.data.rewards import OverlongBufferConfig
from plait.data.rewards import (ScoreRequest, batch_manager, default_compute_score,
                                exact_match_score, load_custom_reward, make_reward, naive_manager,
                                overlong_penalty)
from plait.data.tasks import TASKS, make_task_rows


@pytest.mark.parametrize("response, expected", [
    ("19", 1.0), (" 19\nfoo", 1.0), ("19<eos>", 1.0), ("19=19", 1.0),
    ("190", 0.0), ("1 9", 0.0), ("18", 0.0), ("", 0.0), ("x19", 0.0), ("+19", 0.0),
])
def test_arithmetic_scores(response, expected):
    assert default_compute_score("arithmetic", response, "19") == expected


@pytest.mark.parametrize("response, expected", [
    ("cba", 1.0), ("\ncba\nabc", 1.0), ("cba.", 1.0),
    ("cbax", 0.0), ("cb", 0.0), ("CBA", 0.0), ("c ba", 0.0),
])
def test_reverse_scores(response, expected):
    assert default_compute_score("reverse", response, "cba", extra_info={"index": 0}) == expected


def test_format_score_and_negative_answers():
    assert exact_match_score("arithmetic", "18", "19", format_score=0.1) == 0.1
    assert exact_match_score("arithmetic", "no", "19", format_score=0.1) == 0.0
    assert exact_match_score("arithmetic", "-3", "-3") == 1.0


@pytest.mark.parametrize("task", list(TASKS))
def test_every_ground_truth_scores_one(task):
    for row in make_task_rows(task, "test", 20, seed=0):
        truth = row["reward_model"]["ground_truth"]
        source = row["data_source"]  # gsm8k_synthetic_tools serves gsm8k_synthetic's rows
        response = {"gsm8k_synthetic": f"#### {truth}",  # GSM8K's answer line; geometry3k's think block and box
                    "hiyouga/geometry3k": f"<think>...</think> \\boxed{{{truth}}}"}.get(source, truth)
        result = default_compute_score(source, response, truth, row["extra_info"])
        assert (result["score"], result["acc"]) == (1.0, 1.0) if isinstance(result, dict) else result == 1.0


def test_synthetic_gsm8k_scores_the_last_number_and_reports_the_strict_rule_beside_it():
    assert default_compute_score("gsm8k_synthetic", "3 + 4 = 7\n#### 7", "7") == {"score": 1.0, "acc": 1.0, "strict": 1.0}
    assert default_compute_score("gsm8k_synthetic", "3 + 4 = 7 apples.", "7") == {"score": 1.0, "acc": 1.0, "strict": 0.0}
    assert default_compute_score("gsm8k_synthetic", "7 + 1 = 8\n#### 8", "7") == {"score": 0.0, "acc": 0.0, "strict": 0.0}
    assert default_compute_score("openai/gsm8k", "3 + 4 = 7 apples.", "7") == 0.0  # real GSM8K keeps verl's strict rule


def test_unknown_data_source_says_what_to_do():
    with pytest.raises(ValueError, match="'gsm8k'.*arithmetic, reverse.*custom_reward_function"):
        default_compute_score("gsm8k", "42", "42")


def test_custom_reward_loads_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    hit = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': 2 * hit, 'hit': hit, 'pred': solution_str}\n"
        "def _helper():\n    pass\n")
    fn = load_custom_reward(str(path), "compute_score")
    assert fn("x", " a ", "a") == {"score": 2.0, "hit": 1.0, "pred": " a "}
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path.*nope.py"):
        load_custom_reward(str(tmp_path / "nope.py"), "compute_score")
    with pytest.raises(AttributeError, match="no function 'score_fn'.*functions: compute_score$"):
        load_custom_reward(str(path), "score_fn")


def request(sources, responses, truths, lengths=None):
    return ScoreRequest(sources, responses, truths, [None] * len(responses), lengths or [1] * len(responses))


def test_naive_calls_with_keywords_and_collects_extra_numbers():
    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        if data_source == "plain":
            return 0.5
        return {"score": 1, "acc": True, "len": len(solution_str), "pred": solution_str}

    scores, extras = naive_manager(fn, request(["plain", "rich", "rich"], ["a", "bb", "ccc"],
                                               ["x", ["y", "z"], {"k": 1}]))
    assert scores == [0.5, 1.0, 1.0]
    assert [s[2] for s in seen] == ["x", ["y", "z"], {"k": 1}]  # ground truth as stored
    assert set(extras) == {"acc", "len"}  # strings are not metrics
    assert math.isnan(extras["len"][0]) and extras["len"][1:] == [2.0, 3.0]
    assert extras["acc"][1:] == [1.0, 1.0]


def test_keyword_only_and_async_reward_functions(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(
        "import asyncio\n"
        "async def compute_score(*, data_source, solution_str, ground_truth, extra_info, bonus=0.0):\n"
        "    await asyncio.sleep(0)\n"
        "    return float(solution_str == ground_truth) + bonus\n")
    fn = load_custom_reward(path, "compute_score", reward_kwargs={"bonus": 0.25})
    scores, _ = naive_manager(fn, request(["s", "s"], ["a", "b"], ["a", "a"]))
    assert scores == [1.25, 0.25]


def test_batch_manager_makes_one_call_with_lists():
    calls = []

    def fn(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [{"score": float(s == g), "n": 1} for s, g in zip(solution_strs, ground_truths)]

    scores, extras = batch_manager(fn, request(["s"] * 3, ["a", "b", "a"], ["a"] * 3))
    assert calls == [3] and scores == [1.0, 0.0, 1.0] and extras == {"n": [1.0, 1.0, 1.0]}

    async def judge(data_sources, solution_strs, ground_truths, extra_infos):  # one awaited call
        return [len(s) for s in solution_strs]
    assert batch_manager(judge, request(["s"] * 2, ["a", "bcd"], ["", ""]))[0] == [1.0, 3.0]
    with pytest.raises(ValueError, match="returned 1 results for 3 responses"):
        batch_manager(lambda **kw: [0.0], request(["s"] * 3, ["a"] * 3, ["a"] * 3))


def test_overlong_penalty_by_hand():
    # max 20 tokens, buffer 4: free up to 16 tokens, then -factor * (len - 16) / 4
    assert overlong_penalty(10, 20, 4, 1.0) == 0.0
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0
    assert overlong_penalty(17, 20, 4, 1.0) == -0.25
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5


def test_dapo_manager_adds_the_overlong_penalty():
    score = make_reward(default_compute_score, "dapo", OverlongBufferConfig(True, 4, 1.0, log=True), 20)
    scores, extras = score(request(["math_dapo"] * 3, ["Answer: 3", "Answer: 3", "Answer: 2"], ["3"] * 3,
                                   lengths=[12, 18, 20]))
    assert scores == [1.0, 0.5, -2.0]  # +1, +1 - 2/4, -1 - 4/4
    assert extras["overlong_reward"] == [0.0, -0.5, -1.0] and extras["overlong"] == [0.0, 1.0, 1.0]
    assert extras["acc"] == [1.0, 1.0, 0.0]
    plain = make_reward(default_compute_score, "dapo")  # buffer off: the rule score alone
    assert plain(request(["math_dapo"], ["Answer: 3"], ["3"], lengths=[20]))[0] == [1.0]


def test_reward_config_checks_the_manager_and_reads_dapo_kwargs():
    from plait.configtree import ConfigError, build
    from plait.data.rewards import RewardConfig
    with pytest.raises(ConfigError, match="reward_manager.name='prime'.*naive, batch, dapo"):
        build(RewardConfig, {"reward_manager": {"name": "prime"}})
    with pytest.raises(ConfigError, match="reward_manager.source='importlib'"):
        build(RewardConfig, {"reward_manager": {"source": "importlib"}})
    with pytest.raises(ConfigError, match="dapo with the overlong buffer"):
        build(RewardConfig, {"overlong_buffer": {"enable": True, "len": 4}})
    with pytest.raises(ConfigError, match="overlong_buffer.len"):
        build(RewardConfig, {"reward_manager": {"name": "dapo"}, "overlong_buffer": {"enable": True}})
    recipe = build(RewardConfig, {"reward_manager": {"name": "dapo"}, "reward_kwargs": {
        "overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": False}, "max_resp_len": 20}})
    assert recipe.overlong_buffer == OverlongBufferConfig(True, 4, 1.0, False)
    with pytest.raises(ConfigError, match="unknown: foo"):
        build(RewardConfig, {"reward_kwargs": {"foo": 1}})
    with pytest.raises(ConfigError, match="reward_model.model_path"):
        build(RewardConfig, {"reward_model": {"enable": True}})
    assert build(RewardConfig, {}).num_workers == 8  # verl 0.9's default


def test_bad_results_are_refused():
    req = request(["a"], ["r"], ["g"])
    with pytest.raises(ValueError, match="without 'score'.*keys acc"):
        naive_manager(lambda **kw: {"acc": 1.0}, req)
    with pytest.raises(TypeError, match="returned None for response 0"):
        naive_manager(lambda **kw: None, req)
    with pytest.raises(ValueError, match="one of each per response"):
        ScoreRequest(["arithmetic"], ["1", "2"], ["1", "2"], [None, None], [1, 1])
    scores, _ = naive_manager(default_compute_score, request(["arithmetic", "reverse"], ["12", "olleh"],
                                                             ["12", "hello"]))
    assert scores == [1.0, 0.0]


def test_driver_builds_the_configured_manager():
    from plait.config import load_config
    from plait.data.rewards import resolve_reward
    cfg = load_config(None, ["reward.reward_manager.name=dapo", "data.max_response_length=8",
                             "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                             "reward.overlong_buffer.penalty_factor=2.0"])
    score = resolve_reward(cfg.reward, cfg.data.max_response_length)
    scores, _ = score(request(["math_dapo"] * 2, ["Answer: 3", "Answer: 3"], ["3", "3"], lengths=[4, 7]))
    assert scores == [1.0, -0.5]  # 7 tokens: 3 past 8 - 4, so 1 - 2.0 * 3/4
    from plait.data.reward_pool import close_reward_workers
    close_reward_workers()  # the scores came from reward worker processes
