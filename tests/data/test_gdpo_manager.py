"""verl 0.9.1's `gdpo` reward manager: naive scoring with the run's experiment name in each row's extra_info."""

from plait.data.rewards import ScoreRequest, make_reward


def test_gdpo_manager_scores_like_naive_and_passes_the_experiment_name():
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return {"score": float(solution_str == ground_truth), "format_reward": 0.5}
    request = ScoreRequest(["gsm8k", "gsm8k"], ["4", "5"], ["4", "4"], [{"index": 0}, None], [1, 1])
    scores, extras = make_reward(score, "gdpo", experiment_name="gdpo_run")(request)
    assert scores == [1.0, 0.0] and extras == {"format_reward": [0.5, 0.5]}
    assert seen == [{"index": 0, "experiment_name": "gdpo_run"}, {"experiment_name": "gdpo_run"}]
    naive = make_reward(score, "naive")(request)
    assert naive == (scores, extras) and seen[-1] is None  # naive hands extra_info as the row has it
