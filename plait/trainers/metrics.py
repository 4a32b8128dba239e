"""The language-model pipeline's pure functions over a step's batch and scores: the metrics it logs (data, validation,
agent loops and sessions, rollout-vs-trainer gap, off-policy), DAPO's group filter and the agent loops' scores and
per-session advantages. No state and no workers: plait/trainers/lm.py calls them, tests call them on hand-made
batches.
"""

from __future__ import annotations

import math

import torch

from plait.algorithms.advantages import compute_advantages, spread
from plait.errors import RunError
from plait.profiler.timeline import TIMELINE, WALL0
from plait.trainers.lifecycle import StepResult
from plait.types import RolloutBatch

SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")  # verl's names for the sequence score


def filter_values(metric: str, scores: list[float], extras: dict[str, list[float]]) -> list[float]:
    """Per response, the value DAPO's filter compares within a group: the score, or a key the
    reward function returned (e.g. acc)."""
    if metric in SCORE_METRICS:
        return scores
    if metric not in extras:
        raise RunError(f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such key "
                       f"(it returned: {', '.join(['score', *extras])}); use reward, or a key of its result dict")
    return extras[metric]


def groups_with_signal(values: list[float], group_ids: list[int]) -> set[int]:
    """The groups whose values are not all equal, as verl's filter keeps them (a group of one is kept)."""
    by_group: dict[int, list[float]] = {}
    for g, v in zip(group_ids, values):
        by_group.setdefault(g, []).append(v)
    return {g for g, v in by_group.items() if len(v) == 1 or max(v) != min(v)}


def validation_metrics(sources: list[str], uids: list[int], scores: list[float],
                       extras: dict[str, list[float]] | None = None) -> dict[str, float]:
    """verl's validation names per data source, over prompts (uids) with N responses each, for the
    score ("reward") and each number the reward function returned beside it (e.g. acc):
    <sec>/<source>/<var>/mean@N, best@N/mean and worst@N/mean (the best / worst of a prompt's N
    responses, exact rather than bootstrapped), val-aux/<source>/<var>/std@N (population std).
    As in verl, the core variable is acc when the reward returns it, else reward: its mean@N and
    best@N go under val-core, everything else under val-aux."""
    variables = {"reward": scores, **{k: v for k, v in (extras or {}).items() if len(v) == len(scores)}}
    out = {}
    for source in sorted(set(sources)):
        by_var: dict[str, dict[int, list[float]]] = {}
        for var, values in variables.items():
            for s, uid, value in zip(sources, uids, values):
                if s == source and not math.isnan(value):  # NaN: this response's result lacked the key
                    by_var.setdefault(var, {}).setdefault(uid, []).append(float(value))
        core = "acc" if "acc" in by_var else "reward"
        for var, per_prompt in by_var.items():
            groups = list(per_prompt.values())
            n = max(len(v) for v in groups)
            mean = lambda f: sum(f(v) for v in groups) / len(groups)  # noqa: E731
            sec = "val-core" if var == core else "val-aux"
            out[f"{sec}/{source}/{var}/mean@{n}"] = mean(lambda v: sum(v) / len(v))
            if n > 1:
                out[f"val-aux/{source}/{var}/std@{n}"] = mean(
                    lambda v: (sum((x - sum(v) / len(v)) ** 2 for x in v) / len(v)) ** 0.5)
                out[f"{sec}/{source}/{var}/best@{n}/mean"] = mean(max)
                out[f"val-aux/{source}/{var}/worst@{n}/mean"] = mean(min)
    return out


def merge_results(results: list[StepResult]) -> StepResult:
    """Several local updates as one step: */max and */min metrics by max and min, others averaged; tokens summed."""
    if len(results) == 1:
        return results[0]
    metrics = {}
    for key in {k for r in results for k in r.metrics}:
        values = [r.metrics[key] for r in results if key in r.metrics]
        reduce = max if key.endswith("/max") else min if key.endswith("/min") else (lambda v: sum(v) / len(v))
        metrics[key] = reduce(values)
    return StepResult(metrics, num_tokens=sum(r.num_tokens for r in results),
                      response_tokens=sum(r.response_tokens for r in results))


def loop_scores(batch: RolloutBatch, scores: list[float]) -> list[float]:
    """An agent loop's reward_score replaces the reward function's score of its row (verl's rm_scores). The
    chains of an agent session all take its score: the agent's, else the reward function's on its final chain."""
    if batch.agent_infos is None:
        return scores
    scores = [s if info.get("reward_score") is None else float(info["reward_score"])
              for s, info in zip(scores, batch.agent_infos)]
    final = {i["session"]["id"]: s for s, i in zip(scores, batch.agent_infos) if "session" in i and i["session"]["final"]}
    return [final.get(i["session"]["id"], s) if "session" in i else s for s, i in zip(scores, batch.agent_infos)]


def session_advantages(estimator: str, batch: RolloutBatch, owner: torch.Tensor, norm_by_std: bool) -> torch.Tensor:
    """A per-response estimator over agent sessions [batch, resp_len]: each session is one sample of its group
    (its final chain's row), a failed one none; every chain of a session takes the session's advantage."""
    rows = torch.nonzero(owner == torch.arange(len(owner))).squeeze(-1)
    per_sample, _ = compute_advantages(estimator, token_rewards=batch.token_rewards[rows],
                                       response_mask=batch.response_mask[rows], group_ids=batch.group_ids[rows],
                                       norm_by_std=norm_by_std)
    full = torch.zeros_like(batch.token_rewards).index_copy_(0, rows, per_sample)
    return spread(full, owner, batch.response_mask)


def session_owners(infos: list[dict] | None) -> torch.Tensor | None:
    """Per row [batch], the row that stands for its sample in the advantage: itself, its session's final chain
    (openai_agent), or -1 for a failed session's rows; None when every row stands for itself."""
    if not infos:
        return None
    final = {i["session"]["id"]: r for r, i in enumerate(infos) if "session" in i and i["session"]["final"]}
    owner = [r if "session" not in i else -1 if i["session"]["failure"] else final[i["session"]["id"]]
             for r, i in enumerate(infos)]
    return None if owner == list(range(len(infos))) else torch.tensor(owner)


def record_tool_spans(batch: RolloutBatch) -> None:
    """The agent loops' tool calls (wall clock, timed in the rollout's process) as "tool_calls" spans of
    the rollout role in timeline.jsonl."""
    for info, version in zip(batch.agent_infos or [], batch.versions.tolist()):
        for start, end in info.get("tool_spans", []) if info else []:
            TIMELINE.add("rollout", "tool_calls", start - WALL0, end - WALL0, version)


def agent_metrics(batch: RolloutBatch) -> dict[str, float]:
    """verl's num_turns/{min,max,mean}, agent_loop/{generate_sequences,tool_calls,num_preempted}/{min,max,mean}
    and agent_loop/slowest/* (the trajectory with the most generate + tool seconds), plus plait's
    agent_loop/tool_calls_per_trajectory, agent_loop/tool_error_rate and the tool-call and valid-call
    rates (agents/worker.py tool_call_rates)."""
    from plait.agents.worker import tool_call_rates
    infos = batch.agent_infos
    if not infos or not any(infos):
        return {}
    out = {}
    for name, key in (("num_turns", "num_turns"), ("agent_loop/generate_sequences", "generate_sequences"),
                      ("agent_loop/tool_calls", "tool_calls"), ("agent_loop/num_preempted", "num_preempted")):
        values = [float(i.get(key, 0.0)) for i in infos if i]
        out.update({f"{name}/min": min(values), f"{name}/max": max(values), f"{name}/mean": sum(values) / len(values)})
    total = [i.get("generate_sequences", 0.0) + i.get("tool_calls", 0.0) if i else -1.0 for i in infos]
    slow = total.index(max(total))
    out.update({"agent_loop/slowest/generate_sequences": infos[slow]["generate_sequences"],
                "agent_loop/slowest/tool_calls": infos[slow]["tool_calls"],
                "agent_loop/slowest/num_preempted": infos[slow]["num_preempted"],
                "agent_loop/slowest/prompt_length": float(batch.prompt_mask[slow].sum()),
                "agent_loop/slowest/response_length": float(batch.attended[slow].sum())})
    calls = sum(i.get("tool_calls_made", 0) for i in infos if i)
    out["agent_loop/tool_calls_per_trajectory"] = calls / max(1, sum(1 for i in infos if i))
    out["agent_loop/tool_error_rate"] = sum(i.get("tool_errors", 0) for i in infos if i) / max(calls, 1)
    out.update(tool_call_rates(infos))
    talked = [i for i in infos if i and "interaction_turns" in i]
    if talked:  # plait's: verl logs no interaction metrics of its own
        turns = sum(i["interaction_turns"] for i in talked)
        out["agent_loop/interaction/mean"] = sum(i["interaction"] for i in talked) / len(talked)
        out["agent_loop/interaction_turns_per_trajectory"] = turns / len(talked)
        out["agent_loop/interaction_error_rate"] = sum(i["interaction_errors"] for i in talked) / len(talked)
    out.update(session_metrics(infos))
    return out


def sessions_of(infos: list[dict] | None) -> list[dict]:
    """The openai_agent sessions of a batch, one each (its rows are its chains)."""
    return list({i["session"]["id"]: i["session"] for i in infos or [] if "session" in i}.values())


def session_metrics(infos: list[dict]) -> dict[str, float]:
    """plait's agent/*: sessions, failed_sessions, chains and requests per session, the sessions whose agent
    asked for other sampling settings, the answers whose tool call could not be parsed (returned as text), the
    sessions whose agent failed after the response budget cut an answer (trained as truncated), the trained tokens
    sampled under a decoding grammar (forced tool calls, JSON answers), and the agent's own seconds (its run less its
    calls' time)."""
    sessions = sessions_of(infos)
    if not sessions:
        return {}
    n = len(sessions)
    return {"agent/sessions": n, "agent/failed_sessions": sum(s["failure"] is not None for s in sessions),
            "agent/chains_per_session": sum(s["chains"] for s in sessions) / n,
            "agent/requests_per_session": sum(s["requests"] for s in sessions) / n,
            "agent/sampling_overridden": sum(s["sampling_overridden"] > 0 for s in sessions),
            "agent/unparsed_tool_calls": sum(s["unparsed_tool_calls"] for s in sessions),
            "agent/failed_after_cut": sum(s["failed_after_cut"] is not None for s in sessions),
            "agent/constrained_tokens": sum(s["constrained_tokens"] for s in sessions),
            "agent/agent_s/mean": sum(s["agent_s"] for s in sessions) / n}


def last_token_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's score on its last trained response token: [batch, resp_len]. In an agent
    trajectory that is the last sampled token, not a tool message after it (the mask has holes), so
    the score survives the KL penalty's and the estimators' masking."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    width = response_mask.shape[-1]
    last = width - 1 - response_mask.bool().flip(-1).long().argmax(-1)      # [batch] last index where the mask is 1
    out[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return out * (response_mask.sum(-1, keepdim=True) > 0)


def rollout_probs_diff(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's training/rollout_probs_diff_{max,mean,std}: |p_actor - p_rollout| of the sampled tokens over
    response tokens. In sync mode it is the engine's numerical gap to the actor (a missed weight sync or
    a stale prefix cache shows here); in the async modes it includes the policy lag."""
    diff = (old_logp.exp() - rollout_logp.exp()).abs()[mask.bool()]           # [response tokens]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_max": diff.max().item(), "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0}


def off_policy_metrics(batch: RolloutBatch, version: int) -> dict[str, float]:
    """verl's V1 names, per trajectory: training/off_policy/trajectory_spans (the policy versions its tokens were
    sampled with, oldest to newest: 1 unless a weight sync cut it, partial rollout), trajectory_staleness (the
    trainer's version minus the newest) and trajectory_staleness_worst (minus the oldest), each mean/max/min."""
    tv = batch.token_version_map                                             # [batch, resp_len], -1 off sampled tokens
    sampled = tv >= 0
    oldest = torch.where(sampled, tv, torch.iinfo(torch.long).max).min(-1).values
    oldest = torch.where(sampled.any(-1), oldest, batch.versions)           # [batch]
    newest = batch.versions                                                  # [batch] the version that finished it
    out = {}
    for name, t in (("trajectory_spans", newest - oldest + 1), ("trajectory_staleness", version - newest),
                    ("trajectory_staleness_worst", version - oldest)):
        t = t.float()
        out.update({f"training/off_policy/{name}/mean": t.mean().item(), f"training/off_policy/{name}/max": t.max().item(),
                    f"training/off_policy/{name}/min": t.min().item()})
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


def no_signal_ratio(advantages: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The share of prompt groups whose every response has a zero advantage (GRPO's all-equal rewards): the
    update learns nothing from them (the profile's no-signal alarm, plait/profiler/analysis/alarms.py)."""
    moved = ((advantages.abs() > 1e-6) & mask).any(-1).float()  # [batch] a response with any signal
    groups, row_group = torch.unique(group_ids, return_inverse=True)
    signal = moved.new_zeros(len(groups)).index_add_(0, row_group.to(moved.device), moved)  # [groups] with signal
    return (signal == 0).float().mean().item()


def data_metrics(batch: RolloutBatch, max_prompt_length: int) -> dict[str, float]:
    """verl's data metrics: critic/{score,rewards,advantages,returns,values}, critic/vf_explained_var,
    lengths (all, and of non-aborted responses: an aborted response is an empty one, as in verl)."""
    mask = batch.response_mask.bool()
    out = {}
    seq_score = batch.token_scores.sum(-1)
    seq_reward = batch.token_rewards.sum(-1)
    for name, t in (("score", seq_score), ("rewards", seq_reward)):
        out.update({f"critic/{name}/mean": t.mean().item(), f"critic/{name}/max": t.max().item(),
                    f"critic/{name}/min": t.min().item()})
    for name in ("advantages", "returns", "values"):
        t = getattr(batch, name)
        if t is not None and mask.any():
            v = t[mask]
            out.update({f"critic/{name}/mean": v.mean().item(), f"critic/{name}/max": v.max().item(),
                        f"critic/{name}/min": v.min().item()})
    if batch.advantages is not None:
        out["training/no_signal_group_ratio"] = no_signal_ratio(batch.advantages, mask, batch.group_ids)
    if batch.values is not None and mask.any():
        # 1 - Var(returns - values) / Var(returns) over valid tokens: 1 is a perfect critic, 0 a constant one
        ret, val = batch.returns[mask], batch.values[mask]
        out["critic/vf_explained_var"] = (1.0 - (ret - val).var() / (ret.var() + 1e-5)).item()
    resp_len = batch.attended.sum(-1).float()  # verl's response_length: from the attention mask (tool turns count)
    prompt_len = batch.prompt_mask.sum(-1).float()
    aborted = resp_len == 0
    kept = resp_len[~aborted] if (~aborted).any() else resp_len.new_zeros(1)
    out.update({"response_length_non_aborted/mean": kept.mean().item(), "response_length_non_aborted/max": kept.max().item(),
                "response_length_non_aborted/min": kept.min().item(),
                "response_length_non_aborted/clip_ratio": sum(r == "length" for r, a in zip(batch.stop_reasons, aborted) if not a)
                / max(int((~aborted).sum()), 1),
                "response/aborted_ratio": aborted.float().mean().item(),
                "prompt_length/clip_ratio": (prompt_len >= max_prompt_length).float().mean().item()})
    out.update({"response_length/median": resp_len.median().item(),  # with p99: the tail (profile report's verdict)
                "response_length/p99": torch.quantile(resp_len, 0.99).item()})
    out.update({"response_length/mean": resp_len.mean().item(), "response_length/max": resp_len.max().item(),
                "response_length/min": resp_len.min().item(),
                "response_length/clip_ratio": sum(r == "length" for r in batch.stop_reasons) / len(batch),
                "prompt_length/mean": prompt_len.mean().item(), "prompt_length/max": prompt_len.max().item(),
                "prompt_length/min": prompt_len.min().item()})
    return out


class TokenLedger:
    """A step's token ledger: each sampled token is counted once, when its fate is decided: trained, or discarded
    by a cause (`filtered`: DAPO's filter_groups dropped its group; `stale`: verl's V1 sampler evicted its group
    past max_off_policy_threshold; `rejected`: in the batch but masked out of the loss, by rollout correction's
    rejection or a failed agent session). `tokens/generated` = `tokens/trained` + `tokens/discarded` exactly, per
    step; `tokens/no_signal` is the trained tokens whose advantage is 0 (a group with equal rewards). Tokens cut by a
    weight sync are not waste here: a partial rollout resumes them. What a run's end leaves queued or in flight is
    samples.jsonl's `discarded`, not a step's."""

    CAUSES = ("filtered", "stale", "rejected")

    def __init__(self):
        self.counts = dict.fromkeys(("trained", "no_signal", *self.CAUSES), 0.0)

    def discard(self, cause: str, response_mask: torch.Tensor) -> None:
        self.counts[cause] += float(response_mask.sum())

    def trained(self, batch: RolloutBatch) -> None:
        sampled = batch.response_mask                                          # [batch, resp_len]
        trained = sampled if batch.loss_mask is None else batch.loss_mask * sampled
        self.counts["trained"] += float(trained.sum())
        self.discard("rejected", sampled - trained)
        if batch.advantages is not None:
            self.counts["no_signal"] += float((trained * (batch.advantages.abs() <= 1e-6)).sum())

    def step_metrics(self) -> dict[str, float]:
        """The step's ledger as metrics, and a new one for the next step."""
        c, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        discarded = sum(c[k] for k in self.CAUSES)
        return {"tokens/generated": c["trained"] + discarded, "tokens/trained": c["trained"],
                "tokens/discarded": discarded, **{f"tokens/discarded/{k}": c[k] for k in self.CAUSES},
                "tokens/no_signal": c["no_signal"]}
