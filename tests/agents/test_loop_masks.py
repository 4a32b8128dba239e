"""Two masks: tool / user tokens an agent loop puts in a response are ATTENDED (attention_mask) but
not TRAINED ON (response_mask). Each test feeds a hand-made batch to one consumer and fails if that
consumer reads the wrong mask: the batches differ only where the two masks disagree."""

import pytest
import torch

from plait.algorithms.kl import apply_kl_penalty
from plait.config import ActorConfig, OptimConfig, RolloutCorrectionConfig
from plait.models import create_tiny_model
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.trainers.metrics import data_metrics, last_token_scores
from plait.types import RolloutBatch
from plait.workers.actor import Actor, response_forward
from plait.workers.packing import MicroBatching

# row 0: 2 sampled, 3 tool, 2 sampled, then a 1-token tool message (max turns hit after a tool call);
# row 1: a single-turn row of 4 sampled tokens
TRAINED = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
ATTENDED = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
TOOL = (ATTENDED - TRAINED).bool()


def batch(seed: int = 0, **fields) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    b = RolloutBatch(
        prompts=torch.randint(4, 90, (2, 3), generator=g), prompt_mask=torch.ones(2, 3, dtype=torch.long),
        responses=torch.randint(4, 90, (2, 8), generator=g) * ATTENDED.long(), response_mask=TRAINED.clone(),
        response_attention=ATTENDED.clone(), rollout_logprobs=-torch.rand(2, 8, generator=g) * TRAINED,
        group_ids=torch.tensor([0, 0]), versions=torch.zeros(2, dtype=torch.long), data_sources=["t"] * 2,
        ground_truths=[""] * 2, extra_infos=[{}] * 2, stop_reasons=["length", "eos"],
        advantages=torch.randn(2, 8, generator=g) * TRAINED, ref_logprobs=-torch.rand(2, 8, generator=g) * TRAINED)
    return b.replace(**fields)


def garbage_on_tool_tokens(b: RolloutBatch) -> RolloutBatch:
    """The same batch with wild values where only the attention mask is 1."""
    wild = lambda t, v: torch.where(TOOL, torch.full_like(t, v), t)  # noqa: E731
    return b.replace(advantages=wild(b.advantages, 50.0), rollout_logprobs=wild(b.rollout_logprobs, -30.0),
                     ref_logprobs=wild(b.ref_logprobs, -30.0),
                     old_logprobs=None if b.old_logprobs is None else wild(b.old_logprobs, -30.0))


def test_attention_mask_covers_tool_tokens_and_defaults_for_single_turn_rows():
    b = batch()
    assert b.attention_mask[:, 3:].tolist() == ATTENDED.long().tolist()
    plain = b.replace(response_attention=None, token_versions=None)
    assert plain.attention_mask[:, 3:].tolist() == TRAINED.long().tolist()  # single-turn: the two masks are one
    both = RolloutBatch.concat([b, plain.select([1])])
    assert both.response_attention.tolist() == [*ATTENDED.tolist(), TRAINED[1].tolist()]
    assert both.select([0]).attended.tolist() == [ATTENDED[0].tolist()]


def test_reward_lands_on_the_last_trained_token_not_a_trailing_tool_message():
    scores = last_token_scores([1.0, 2.0], TRAINED)
    assert scores[0].nonzero().flatten().tolist() == [6] and scores[1].nonzero().flatten().tolist() == [3]
    rewards, _ = apply_kl_penalty(scores, torch.zeros(2, 8), torch.zeros(2, 8), TRAINED, 0.1, "k1")
    assert rewards.sum(-1).tolist() == [1.0, 2.0]  # the KL penalty's masking keeps it


def test_data_metrics_count_tool_tokens_in_response_length_but_not_in_advantages():
    b = batch(token_scores=torch.zeros(2, 8), token_rewards=torch.zeros(2, 8))
    m, g = data_metrics(b, 3), data_metrics(garbage_on_tool_tokens(b), 3)
    assert m["response_length/mean"] == 6.0 and m["response_length/max"] == 8.0  # verl's: from the attention mask
    assert m["critic/advantages/max"] == g["critic/advantages/max"] < 50


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("m") / "m", size="xs", seed=0)


def actor(model_path, **cfg) -> Actor:
    session = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0)
    c = ActorConfig(optim=OptimConfig(lr=1e-2, total_training_steps=4), ppo_mini_batch_size=2, **cfg)
    return Actor(model_path, c, 1, 1.0, session.for_role("actor"))


def weights(a: Actor) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in a.model.parameters()])


@pytest.mark.parametrize("case", ["fused", "kl_entropy", "bypass_rs"])
def test_actor_update_ignores_tool_tokens(model_path, case):
    """Loss, entropy, KL, and rollout correction see only sampled tokens: wild advantages and log-probs
    on tool tokens change nothing. Control: the same wildness on one sampled token changes the update."""
    cfg, correction, fields = {}, None, {}
    if case == "kl_entropy":
        cfg = dict(use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.1)
        fields = dict(old_logprobs=batch().rollout_logprobs)
    if case == "bypass_rs":
        correction = RolloutCorrectionConfig(bypass_mode=True, rollout_is="token", rollout_rs="seq_max_k3",
                                             rollout_rs_threshold=20.0)  # tool garbage: k3 ~ e^25
        fields = dict(old_logprobs=batch().rollout_logprobs)
    runs = {}
    for name, b in (("clean", batch(**fields)), ("tool", garbage_on_tool_tokens(batch(**fields)))):
        a = actor(model_path, **cfg)
        metrics = a.update(b, correction)
        runs[name] = metrics, weights(a)
    assert runs["clean"][0]["actor/pg_loss"] == pytest.approx(runs["tool"][0]["actor/pg_loss"], abs=1e-6)
    assert runs["clean"][0]["actor/entropy"] == pytest.approx(runs["tool"][0]["actor/entropy"], abs=1e-6)
    assert torch.allclose(runs["clean"][1], runs["tool"][1])
    sampled = batch(**fields)
    sampled.advantages[0, 5] = 50.0
    a = actor(model_path, **cfg)
    a.update(sampled, correction)
    assert not torch.allclose(runs["clean"][1], weights(a))


def test_tool_tokens_are_attended_by_the_log_prob_forward(model_path):
    """The log-prob of a sampled token after a tool message depends on the tool message's tokens."""
    a = actor(model_path)
    b = batch()
    other = b.responses.clone()
    other[0, 2:5] = (other[0, 2:5] + 7) % 90 + 4
    logp, _ = a.compute_log_prob(b, 2)
    logp2, _ = a.compute_log_prob(b.replace(responses=other), 2)
    assert logp[0, 5] != pytest.approx(logp2[0, 5].item())
    assert torch.equal(logp[0, :2], logp2[0, :2])


def test_packed_and_dynamic_batches_cover_tool_tokens(model_path):
    """Packing (remove_padding) keeps tool tokens in the sequence (same log-probs as padded); the token
    budget of dynamic batching counts them."""
    b, model = batch(), actor(model_path).model
    logp, _ = response_forward(model, b, 1.0, MicroBatching(2, None, False), with_entropy=False)
    logp_packed, _ = response_forward(model, b, 1.0, MicroBatching(2, None, True), with_entropy=False)
    assert torch.allclose(logp * TRAINED, logp_packed * TRAINED, atol=1e-5)
    # attended lengths 11 and 7: a budget of 14 tokens cannot hold both (trained lengths 7 + 7 could)
    assert MicroBatching(None, 14, False).split(b) == [[0], [1]]
    assert MicroBatching(None, 14, False).split(b.replace(response_attention=None)) == [[0, 1]]


def test_critic_values_and_loss_ignore_tool_tokens(model_path):
    from plait.config import CriticConfig
    from plait.workers.critic import Critic
    session = ProfilerSession(GlobalProfilerConfig(), {"critic": RoleProfilerConfig()}, rank=0)
    cfg = CriticConfig(optim=OptimConfig(lr=1e-2, total_training_steps=4), ppo_mini_batch_size=2, ppo_epochs=1)
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(2, 8, generator=g) * TRAINED
    runs, control = [], returns.clone()
    control[0, 5] = 50.0  # wild on a trained token: must change the update
    for r in (returns, torch.where(TOOL, torch.full_like(returns, 50.0), returns), control):
        critic = Critic(model_path, cfg, 1, session.for_role("critic"))
        b = batch(values=torch.zeros(2, 8), returns=r)
        values = critic.compute_values(b)
        assert (values[TOOL] == 0).all()  # no value on tool tokens
        critic.update(b)
        runs.append(torch.cat([p.detach().flatten() for p in critic.model.parameters()]))
    assert torch.allclose(runs[0], runs[1]) and not torch.allclose(runs[0], runs[2])
