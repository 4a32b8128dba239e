"""Packed sequences, token-balanced micro-batches, the fused pi_old, gradient checkpointing and MFU:
each is checked against the plain path (padded, fixed micro-batches, separate old_log_prob pass)
on a tiny real model."""

import pytest
import torch

from plait.config import ActorConfig, CriticConfig, OptimConfig
from plait.models import create_tiny_model
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.trainers.metrics import rollout_probs_diff
from plait.types import RolloutBatch
from plait.workers.actor import Actor, micro_forward
from plait.workers.critic import Critic
from plait.workers.flops import ModelFlops
from plait.workers.packing import checked_remove_padding, micro_batches, pack, seqlen_metrics, unpack

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "xs", size="xs", seed=0)


def profiler(role: str):
    return ProfilerSession(GlobalProfilerConfig(), {role: RoleProfilerConfig()}, rank=0).for_role(role)


def make_batch(rows: int = 8, prompt_len: int = 6, resp_len: int = 9, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of varied lengths (one of each at full width)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt_len + 1, (rows,), generator=g)
    r_len = torch.randint(1, resp_len + 1, (rows,), generator=g)
    p_len[0], r_len[0] = prompt_len, resp_len
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - p_len[:, None]).long()   # [rows, prompt_len]
    response_mask = (torch.arange(resp_len) < r_len[:, None]).float()                 # [rows, resp_len]
    rand = lambda: torch.randn(rows, resp_len, generator=g) * response_mask  # noqa: E731
    return RolloutBatch(
        prompts=torch.randint(4, 90, (rows, prompt_len), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        responses=torch.randint(4, 90, (rows, resp_len), generator=g) * response_mask.long(),
        response_mask=response_mask, rollout_logprobs=-rand().abs() - 4.0, group_ids=torch.arange(rows) // 4,
        versions=torch.zeros(rows, dtype=torch.long), data_sources=["t"] * rows, ground_truths=[""] * rows,
        extra_infos=[{}] * rows, stop_reasons=["eos"] * rows, advantages=rand(), values=rand(), returns=rand())


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def assert_close(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tol, worst


def test_micro_batches_fixed_and_token_budget():
    assert micro_batches([5, 1, 7, 2, 3], 2) == [[0, 1], [2, 3], [4]]
    lengths = [30, 3, 5, 12, 9, 8, 2, 20, 7, 4]
    bins = micro_batches(lengths, micro_batch_size=1, max_tokens=32)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))    # every row exactly once
    loads = [sum(lengths[r] for r in b) for b in bins]
    assert max(loads) <= 32 and len(bins) == 4                               # 100 tokens: 4 bins of <= 32
    assert max(loads) - min(loads) <= max(lengths)
    assert micro_batches([50, 3], 1, max_tokens=10) == [[0], [1]]          # too long: a bin of its own


def test_pack_unpack_round_trip():
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])
    ids = torch.arange(1, 21).view(4, 5)
    packed = pack(ids, mask)   # rows of 4 (the longest), longest first: [b1], [b0 b2], [b3 + tail]
    assert packed.input_ids.tolist() == [[6, 7, 8, 9], [2, 3, 14, 15], [20, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 1, 2]]
    back = unpack(packed.input_ids[..., None].float(), packed, mask.shape)[..., 0]
    assert torch.equal(back, (ids * mask).float())
    m = seqlen_metrics(mask)
    assert m["global_seqlen/real_tokens"] == 9 and m["global_seqlen/padding_ratio"] == 0.55


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_forward_equals_padded_logprobs_entropy_and_grads(model_dir, device):
    actor = Actor(model_dir, ActorConfig(), 1, 0.7, profiler("actor"), device=device)
    batch = make_batch()
    mask = batch.response_mask.bool()
    out = {}
    for packed in (False, True):
        actor.model.zero_grad()
        logp, ent = micro_forward(actor.model, batch, 0.7, True, remove_padding=packed)
        ((logp * batch.advantages.to(device)).sum() + ent[mask.to(device)].sum()).backward()
        out[packed] = (logp.cpu()[mask], ent.cpu()[mask], {k: p.grad.cpu() for k, p in actor.model.named_parameters()})
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    assert torch.allclose(out[True][1], out[False][1], atol=1e-5)
    assert_close(out[True][2], out[False][2], tol=1e-4)


def test_packed_dynamic_update_equals_padded_fixed(model_dir):
    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=3,
                      entropy_coeff=0.01)
    batch = make_batch(8)
    batch.old_logprobs = -batch.rollout_logprobs.abs() - 3.0
    plain = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3)
    fast = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3, remove_padding=True, max_token_len=24)
    before = params(plain.model)
    m_plain, m_fast = plain.update(batch), fast.update(batch)
    with pytest.raises(AssertionError):
        assert_close(params(plain.model), before, tol=1e-4)                  # the update moved the weights
    assert_close(params(fast.model), params(plain.model), tol=2e-5)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m_fast[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-6)


def test_fused_old_log_prob_equals_recompute_path(model_dir):
    """One mini-batch, one epoch: pi_old from the update's own forward == a separate pass."""
    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=3)
    batch = make_batch(8)
    recompute = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3)
    fused = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3)
    old_logp, _ = recompute.compute_log_prob(batch, 5)
    m_re = recompute.update(batch.replace(old_logprobs=old_logp))
    m_fu = fused.update(batch)                                                # old_logprobs None
    assert_close(params(fused.model), params(recompute.model), tol=1e-5)
    assert m_fu["actor/pg_loss"] == pytest.approx(m_re["actor/pg_loss"], abs=1e-6)
    # verl's three metrics on the fused path too (it logged only the mean), equal to the separate pass's
    want = rollout_probs_diff(old_logp, batch.rollout_logprobs, batch.response_mask)
    assert set(want) == {f"training/rollout_probs_diff_{s}" for s in ("max", "mean", "std")}
    for key, value in want.items():
        assert m_fu[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
    assert "training/rollout_probs_diff_square" not in m_fu


def test_gradient_checkpointing_same_update(model_dir):
    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4)
    batch = make_batch(8)
    plain = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3)
    ckpt = Actor(model_dir, cfg, 1, 1.0, profiler("actor"), seed=3, gradient_checkpointing=True)
    assert ckpt.model.is_activation_checkpointing
    plain.update(batch), ckpt.update(batch)
    assert_close(params(ckpt.model), params(plain.model), tol=1e-6)


def test_critic_packed_dynamic_equals_padded(model_dir):
    cfg = CriticConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=3)
    batch = make_batch(8)
    plain = Critic(model_dir, cfg, 1, profiler("critic"))
    fast = Critic(model_dir, cfg, 1, profiler("critic"), remove_padding=True, max_token_len=20,
                  forward_max_token_len=30, gradient_checkpointing=True)
    plain.update(batch), fast.update(batch)                                  # moves the zero head off zero
    assert_close(params(fast.model), params(plain.model), tol=2e-5)
    assert torch.allclose(fast.compute_values(batch), plain.compute_values(batch), atol=1e-5)


def test_model_flops_and_mfu_metric(model_dir):
    actor = Actor(model_dir, ActorConfig(ppo_mini_batch_size=8), 1, 1.0, profiler("actor"))
    f = actor.flops
    cfg = actor.model.config
    layer = 2 * cfg.hidden_size * (cfg.num_attention_heads + cfg.num_key_value_heads) * (cfg.hidden_size // cfg.num_attention_heads) \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    assert f.params == cfg.num_hidden_layers * layer + cfg.hidden_size * cfg.vocab_size
    assert f.forward([3]) == 2 * f.params * 3 + 2 * cfg.num_hidden_layers * cfg.hidden_size * 9
    assert ModelFlops(10, 1, 1, peak=100.0).mfu(50.0, 2.0) == 0.25
    mfu = actor.update(make_batch(8))["perf/mfu/actor"]
    assert 0 < mfu < 1


class PrefixMeanLM(torch.nn.Module):
    """A causal LM that ignores positions: each token sees the mean of everything before it in its
    row, so packed sequences would see each other."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 16, "model_type": "prefix_mean",
                                          "get_text_config": lambda config: config})()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        h = self.embed(input_ids)                                              # [batch, len, 8]
        weights = torch.ones_like(input_ids, dtype=h.dtype) if attention_mask is None else attention_mask.to(h.dtype)
        mean = (h * weights[..., None]).cumsum(1) / weights.cumsum(1).clamp(min=1)[..., None]
        return type("Out", (), {"logits": self.head(mean)})()


def test_a_model_that_mixes_packed_sequences_falls_back_to_padding(model_dir):
    actor = Actor(model_dir, ActorConfig(), 1, 1.0, profiler("actor"), remove_padding=True)
    assert actor.layout.remove_padding and actor.model.training  # the check left training mode on
    with pytest.warns(UserWarning, match="PrefixMeanLM mixes packed sequences"):
        assert not checked_remove_padding(PrefixMeanLM(), True)
