"""Response-only, chunked log-probs (plait/workers/logprobs.py) against the full-vocabulary path they
replace: log-probs, entropy and the gradients of every parameter, padded and packed, temperature != 1,
with LoRA and under FSDP2, on a tiny real model."""

import pytest
import torch

from plait.algorithms.losses import entropy_from_logits, token_logprobs
from plait.configtree import ConfigError
from plait.models import add_lora, create_tiny_model, load_causal_lm
from plait.workers.actor import micro_forward
import plait.workers.logprobs as logprobs
from plait.workers.logprobs import Support, _HeadLogpEntropy, _LogpEntropy, check_lm_head, chunked_logprobs
from plait.workers.packing import pack, unpack

from tests.workers.test_packing import make_batch

torch.set_num_threads(1)
T = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "xs", size="xs", seed=0)


def full_vocab_forward(model, micro, temperature, remove_padding):
    """The path before: logits [rows, len, vocab] over every position, then the response slice."""
    input_ids, mask, resp_len = micro.input_ids, micro.attention_mask, micro.responses.shape[1]
    if remove_padding:
        packed = pack(input_ids, mask)
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                       use_cache=False).logits.float() / temperature
        logp = unpack(token_logprobs(logits, packed.input_ids.roll(-1, dims=1)), packed, mask.shape)
        return logp[:, -resp_len - 1:-1], unpack(entropy_from_logits(logits), packed, mask.shape)[:, -resp_len - 1:-1]
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   use_cache=False).logits[:, -resp_len - 1:-1].float() / temperature
    return token_logprobs(logits, input_ids[:, -resp_len:]), entropy_from_logits(logits)


def logp_ent_grads(model, batch, forward):
    """Log-probs, entropy (real tokens) and every trainable parameter's gradient of a loss using both."""
    model.zero_grad()
    mask = batch.response_mask.bool()
    logp, ent = forward(model, batch)
    ((logp * batch.advantages)[mask].sum() + 0.3 * ent[mask].sum()).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return logp[mask].detach(), ent[mask].detach(), grads


def assert_same(new, old, tol=2e-5):
    torch.testing.assert_close(new[0], old[0], atol=tol, rtol=tol)        # log-probs
    torch.testing.assert_close(new[1], old[1], atol=tol, rtol=tol)        # entropy
    assert new[2].keys() == old[2].keys() and new[2]
    for k in old[2]:
        torch.testing.assert_close(new[2][k], old[2][k], atol=tol, rtol=1e-3, msg=k)


class SubclassedHead(torch.nn.Linear):
    """Not a plain Linear (as a peft adapter on the head is not): autograd through a checkpoint per chunk."""


@pytest.mark.parametrize("head_cls,grad_budget", [(torch.nn.Linear, 2 ** 26), (torch.nn.Linear, 11 * 4 * 2),
                                                   (SubclassedHead, 2 ** 26)],
                         ids=["fused", "fused-weight-grad-every-2-tokens", "checkpointed"])
def test_chunked_logprobs_by_hand_and_gradients(monkeypatch, head_cls, grad_budget):
    monkeypatch.setattr(logprobs, "GRAD_BUDGET", grad_budget)  # 11-word vocabulary: one matmul per 2 tokens' logits
    g = torch.Generator().manual_seed(0)
    head = head_cls(8, 11, bias=True)
    hidden = torch.randn(7, 8, generator=g, requires_grad=True)
    tokens = torch.randint(0, 11, (7,), generator=g)
    w_logp, w_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)
    wrt = [hidden, head.weight, head.bias]

    def full():
        z = head(hidden) / T
        return token_logprobs(z, tokens), entropy_from_logits(z)
    want = full()
    want_grads = torch.autograd.grad((want[0] * w_logp).sum() + (want[1] * w_ent).sum(), wrt)
    for chunk in (1, 3, 100):
        logp, ent = chunked_logprobs(hidden, tokens, head, T, True, chunk_tokens=chunk)
        torch.testing.assert_close(logp, want[0]), torch.testing.assert_close(ent, want[1])
        grads = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), wrt)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b)
    # each output alone: the hand-written backward with the other gradient absent
    logp, ent = chunked_logprobs(hidden, tokens, head, T, True, chunk_tokens=3)
    for a, b in zip(torch.autograd.grad(ent.sum(), wrt), torch.autograd.grad(full()[1].sum(), wrt)):
        torch.testing.assert_close(a, b)
    logp, ent = chunked_logprobs(hidden, tokens, head, T, False, chunk_tokens=3)
    assert ent is None
    for a, b in zip(torch.autograd.grad(logp.sum(), wrt), torch.autograd.grad(full()[0].sum(), wrt)):
        torch.testing.assert_close(a, b)


def test_hand_backward_passes_gradcheck():
    z = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 4, 2])
    several = torch.tensor([[0, 4, 4], [4, 1, 2], [2, 2, 0]])  # several tokens per position (a top-k gather)
    for toks in (tokens, several):
        assert torch.autograd.gradcheck(lambda z: _LogpEntropy.apply(z, toks, True, 2)[:2], (z,))
    h, w, b = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((7, 4), (5, 4), (5,)))
    tokens = torch.tensor([0, 4, 2, 1, 1, 0, 4])  # token 3, banned below, is never a target
    several = torch.stack([tokens, tokens.flip(0), torch.tensor([1, 1, 0, 2, 4, 4, 0])], 1)  # [7, 3]
    for grad_budget in (2 ** 26, 5 * 8 * 2):  # one weight-gradient matmul, or one per 2 chunks
        logprobs.GRAD_BUDGET, was = grad_budget, logprobs.GRAD_BUDGET
        try:  # chunks of 2 tokens, the last one short; temperature != 1; a banned token
            for toks in (tokens, several):
                assert torch.autograd.gradcheck(lambda h, w, b: _HeadLogpEntropy.apply(
                    h, w, b, toks, T, True, 2, [3], torch.float64, 2)[:2], (h, w, b))
        finally:
            logprobs.GRAD_BUDGET = was


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_response_logprobs_equal_the_full_vocabulary_path(model_dir, packed):
    model = load_causal_lm(model_dir)
    batch = make_batch(rows=6, prompt_len=7, resp_len=9)
    old = logp_ent_grads(model, batch, lambda m, b: full_vocab_forward(m, b, T, packed))
    new = logp_ent_grads(model, batch, lambda m, b: micro_forward(m, b, T, True, remove_padding=packed))
    assert_same(new, old)
    logp, ent = micro_forward(model, batch, T, True, remove_padding=packed)
    assert (logp[~batch.response_mask.bool()] == 0).all() and (ent[~batch.response_mask.bool()] == 0).all()
    with torch.no_grad():  # the no-grad passes (pi_old, ref) take the same path unchecked
        torch.testing.assert_close(micro_forward(model, batch, T, False, packed)[0], logp.detach())


def test_bf16_model_gets_float32_logprobs(model_dir):
    model = load_causal_lm(model_dir, dtype=torch.bfloat16)
    batch = make_batch(rows=4)
    with torch.no_grad():
        old, _ = full_vocab_forward(model, batch, T, False)
        new, _ = micro_forward(model, batch, T, False)
    assert new.dtype == torch.float32
    mask = batch.response_mask.bool()
    torch.testing.assert_close(new[mask], old[mask], atol=2e-2, rtol=0)  # the two bf16 forwards' rounding


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lora_logprobs_and_adapter_gradients(model_dir, packed):
    torch.manual_seed(0)
    model = add_lora(load_causal_lm(model_dir), 4, 8, "all-linear")
    with torch.no_grad():  # B starts at 0: move it so that the adapters change the policy and get every gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = make_batch(rows=5)
    old = logp_ent_grads(model, batch, lambda m, b: full_vocab_forward(m, b, T, packed))
    new = logp_ent_grads(model, batch, lambda m, b: micro_forward(m, b, T, True, remove_padding=packed))
    assert all("lora_" in k for k in new[2])
    assert_same(new, old)
    with torch.no_grad(), model.disable_adapter():  # the reference: the base model's log-probs
        base, _ = micro_forward(model, batch, T, False, packed)
    plain, _ = full_vocab_forward(load_causal_lm(model_dir), batch, T, packed)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(base[mask], plain[mask].detach(), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(base[mask], new[0], atol=1e-3)


def _fsdp2_rank(rank: int, model_dir: str, rdzv: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    model = load_causal_lm(model_dir)
    batches = [(make_batch(rows=4, seed=s), packed) for s, packed in enumerate([False, True, False])]
    want = [logp_ent_grads(model, b, lambda m, b: full_vocab_forward(m, b, T, packed)) for b, packed in batches]
    constrained = make_batch(rows=4, seed=3)  # a decoding grammar's allowed sets (the head's logits at once here)
    constrained.grammar_masks = random_grammar(constrained, model.config.vocab_size)
    batches.append((constrained, True))
    want.append(logp_ent_grads(model, constrained, lambda m, b: masked_full_vocab_forward(m, b, T)))
    for block in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    for (b, packed), old in zip(batches, want):
        with torch.no_grad():  # a pi_old pass between updates
            micro_forward(model, b, T, True, packed)
        new = logp_ent_grads(model, b, lambda m, b: micro_forward(m, b, T, True, packed))
        assert_same((new[0], new[1], {k: g.full_tensor() for k, g in new[2].items()}), old)  # the ranks' mean
    dist.barrier()  # neither rank tears the group down while the other still talks to it
    dist.destroy_process_group()


def test_fsdp2_sharded_model_gives_the_same_logprobs_and_gradients(model_dir, tmp_path):
    """Blocks and root sharded over 2 gloo ranks (reshard after forward, verl's default), each with the
    same rows: log-probs and the averaged gradients equal the unsharded model's, padded and packed, and over a
    decoding grammar's allowed sets.
    (With the root not resharding, FSDP2 in torch 2.13 gets the root's gradients wrong after a no-grad
    forward on the old path too.)"""
    import torch.multiprocessing as mp
    mp.spawn(_fsdp2_rank, args=(model_dir, str(tmp_path / "rdzv")), nprocs=2)


def test_model_whose_logits_are_not_the_head_of_the_last_hidden_state_is_refused(model_dir):
    model = load_causal_lm(model_dir)
    check_lm_head(model, "actor_rollout_ref.model.path")  # a plain head passes

    def soft_cap(module, args, out):  # as Gemma 2 caps its logits after the head
        out["logits"] = torch.tanh(out["logits"] / 3) * 3
        return out
    model.register_forward_hook(soft_cap)
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path.*last hidden state"):
        check_lm_head(model, "actor_rollout_ref.model.path")


def random_kept(batch, vocab: int, k: int, seed: int = 0) -> torch.Tensor:
    """[rows, resp_len, k] kept sets holding each response token and k - 1 others (some -1), and one position of
    all -1 per row (a token an agent loop inserted: the whole vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randint(0, vocab, (*batch.responses.shape, k), generator=g)
    kept[..., 0] = batch.responses
    kept[..., -1] = -1
    kept[:, 0] = -1
    return kept


def masked_full_vocab_forward(model, micro, temperature):
    """The reference: full-vocabulary logits with every id outside the position's kept set (and, where a grammar
    constrained it, outside the grammar's allowed ids) at -inf."""
    input_ids, mask, resp_len = micro.input_ids, micro.attention_mask, micro.responses.shape[1]
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   use_cache=False).logits[:, -resp_len - 1:-1].float() / temperature
    outside = torch.zeros(logits.shape, dtype=torch.bool)
    kept = micro.sampled_from
    if kept is not None:
        outside = torch.ones(*logits.shape[:2], logits.shape[-1] + 1, dtype=torch.bool)
        outside.scatter_(-1, kept.masked_fill(kept < 0, logits.shape[-1]), False)
        outside = outside[..., :-1] & ~(kept < 0).all(-1, keepdim=True)
    for row, g in enumerate(micro.grammar_masks or []):
        for col, words in zip(g["cols"].tolist(), g["bits"]) if g else ():
            for token in range(logits.shape[-1]):  # bit by bit, as the words say it
                outside[row, col, token] |= not (token < 32 * len(words) and int(words[token // 32]) >> (token % 32) & 1)
    z = logits.masked_fill(outside, float("-inf"))
    logq = z.log_softmax(-1)
    ent = -(logq.exp() * logq.masked_fill(outside, 0)).sum(-1)
    return logq.gather(-1, input_ids[:, -resp_len:, None])[..., 0], ent


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_logprobs_over_the_samplers_kept_set(model_dir, packed):
    """Top-k / top-p: log-probs, entropy and gradients are the softmax over each position's kept set, where the
    sampler drew the token from; a kept set of one token gives log-prob 0 (top_k=1)."""
    model = load_causal_lm(model_dir)
    batch = make_batch(rows=6, prompt_len=7, resp_len=9)
    batch.sampled_from = random_kept(batch, model.config.vocab_size, k=4)
    want = logp_ent_grads(model, batch, lambda m, b: masked_full_vocab_forward(m, b, T))
    got = logp_ent_grads(model, batch, lambda m, b: micro_forward(m, b, T, True, remove_padding=packed))
    assert_same(got, want)
    whole = logp_ent_grads(model, batch.replace(sampled_from=None), lambda m, b: micro_forward(m, b, T, True))
    assert (whole[0] < got[0] - 1e-3).any()  # over the whole vocabulary the sampled tokens are less likely
    only = batch.replace(sampled_from=batch.responses[..., None])  # top_k=1: each token was certain
    with torch.no_grad():
        logp, _ = micro_forward(model, only, T, False, remove_padding=packed)
    assert logp[batch.response_mask.bool()].abs().max() == 0


def test_hand_backward_over_a_kept_set_passes_gradcheck():
    h, w, b = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((7, 4), (5, 4), (5,)))
    tokens = torch.tensor([0, 4, 2, 1, 1, 0, 4])
    kept = torch.tensor([[0, 1, -1], [4, -1, -1], [2, 0, 4], [-1, -1, -1], [1, 2, 3], [0, 4, -1], [4, 0, 1]])
    bits = torch.tensor([[0b00101], [0b10110], [0b11111]], dtype=torch.int32)  # ids {0, 2}, {1, 2, 4}, all 5
    for support in (Support(kept), Support(None, torch.tensor([0, 3, 4]), bits), Support(kept, torch.tensor([2, 4, 6]), bits)):
        assert torch.autograd.gradcheck(lambda h, w, b: _HeadLogpEntropy.apply(
            h, w, b, tokens, T, True, 2, None, torch.float64, 0, support)[:2], (h, w, b))
    logp = _HeadLogpEntropy.apply(h, w, b, tokens, T, True, 2, None, torch.float64, 0, Support(kept))[0]
    assert logp[1] == 0  # a kept set of one
    logp = _HeadLogpEntropy.apply(h, w, b, tokens, T, True, 2, None, torch.float64, 0,
                                  Support(kept, torch.tensor([2]), torch.tensor([[0b100]], dtype=torch.int32)))[0]
    assert logp[2] == 0  # kept {2, 0, 4} and a grammar allowing {2}: one token


def random_grammar(batch, vocab: int, seed: int = 0) -> list[dict]:
    """Per row, grammar masks at every other response column: random allowed sets holding the sampled token; {} for
    the last row (unconstrained)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in range(len(batch) - 1):
        cols = torch.arange(row % 2, int(batch.attended[row].sum()), 2)
        allowed = torch.rand(len(cols), vocab, generator=g) < 0.3
        allowed[torch.arange(len(cols)), batch.responses[row, cols]] = True
        words = torch.zeros(len(cols), (vocab + 31) // 32, dtype=torch.int64)
        for i in range(vocab):
            words[:, i // 32] |= allowed[:, i].long() << (i % 32)
        out.append({"cols": cols, "bits": words.to(torch.int32)})  # (wraps to int32's sign bit, as llguidance writes)
    return out + [{}]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("with_kept", [False, True], ids=["grammar", "grammar+kept"])
def test_logprobs_over_a_grammars_allowed_set(model_dir, monkeypatch, packed, with_kept):
    """A decoding grammar: at the positions it constrained, log-probs, entropy and gradients are the softmax over the
    ids it allowed (and the kept set's, where both), chunk by chunk (3 tokens a chunk here)."""
    model = load_causal_lm(model_dir)
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET", 3 * model.config.vocab_size)
    batch = make_batch(rows=6, prompt_len=7, resp_len=9)
    batch.grammar_masks = random_grammar(batch, model.config.vocab_size)
    if with_kept:
        batch.sampled_from = random_kept(batch, model.config.vocab_size, k=40)
    want = logp_ent_grads(model, batch, lambda m, b: masked_full_vocab_forward(m, b, T))
    got = logp_ent_grads(model, batch, lambda m, b: micro_forward(m, b, T, True, remove_padding=packed))
    assert_same(got, want)
    whole = logp_ent_grads(model, batch.replace(grammar_masks=None), lambda m, b: micro_forward(m, b, T, True))
    assert (whole[0] < got[0] - 1e-3).any()  # without the grammar the sampled tokens are less likely
    with torch.no_grad():
        assert torch.equal(micro_forward(model, batch.select([5, 0]), T, False)[0][1],
                           micro_forward(model, batch, T, False)[0][0])  # rows selected carry their masks


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_micro_batch_with_no_response_token_scores_nothing_and_trains_nothing(model_dir, packed):
    """Every row a failed agent session that never called the model: zeros, and a backward that runs."""
    model = load_causal_lm(model_dir)
    batch = make_batch(rows=3)
    batch.response_mask = torch.zeros_like(batch.response_mask)
    logp, ent = micro_forward(model, batch, T, True, remove_padding=packed)
    assert logp.shape == batch.responses.shape and not logp.any() and not ent.any()
    (logp.sum() + ent.sum()).backward()
    with torch.no_grad():
        assert not micro_forward(model, batch, T, False, remove_padding=packed)[0].any()
