"""TransformersEngine against HF generate and a teacher-forced forward, on tiny random models."""

import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from plait.configtree import ConfigError
from plait.workers import rollout_engine
from plait.workers.rollout_engine import SamplingParams, TransformersEngine, sample_tokens

PAD = 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23], [30, 31], [40, 41, 42, 43, 44, 45]]


def qwen(seed: int = 0) -> Qwen2ForCausalLM:
    # initializer_range 0.2: at HF's default 0.02 a tied tiny model just repeats its last token
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                      initializer_range=0.2, pad_token_id=PAD)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return qwen()


@pytest.fixture(params=["llama_layout", "hf_forward"])
def path(request, monkeypatch):
    """Run a test through both steppers: the module-by-module one and the generic HF forward."""
    monkeypatch.setattr(rollout_engine, "_is_llama_layout", lambda config: request.param == "llama_layout")
    return request.param


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_greedy(model, prompts, max_new_tokens, eos):
    ids, mask = left_padded(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD)
    return out[:, ids.shape[1]:]


def test_greedy_matches_hf_generate_with_eos_and_padding(model, path):
    free = hf_greedy(model, PROMPTS, 12, None)
    # EOS ids that end more than half the rows by step 2, so finished rows are dropped mid-call
    eos = sorted(set(free[:4, 1].tolist()))
    ref = hf_greedy(model, PROMPTS, 12, eos)
    out = TransformersEngine(model, PAD, eos).generate(PROMPTS, SamplingParams(max_new_tokens=12, do_sample=False))
    assert torch.equal(out.responses, ref)
    assert out.stop_reasons.count("eos") >= 4 and "length" in out.stop_reasons
    lengths = out.response_mask.sum(1).long()
    for row, reason, n in zip(out.responses, out.stop_reasons, lengths.tolist()):
        assert (row[n - 1].item() in eos) == (reason == "eos")   # the EOS token is kept, mask 1
        assert (row[n:] == PAD).all()
    assert out.response_mask.dtype == torch.float32
    assert torch.equal(out.response_mask, (torch.arange(12)[None] < lengths[:, None]).float())
    assert (out.logprobs[out.response_mask == 0] == 0).all() and (out.logprobs[out.response_mask == 1] < 0).all()


def test_greedy_matches_hf_generate_llama_and_gpt2():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, initializer_range=0.2,
                                         attention_bias=True, head_dim=8, pad_token_id=PAD)).eval()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      initializer_range=0.2, bos_token_id=1, eos_token_id=2)).eval()
    assert rollout_engine._is_llama_layout(llama.config) and not rollout_engine._is_llama_layout(gpt2.config)
    for m in (llama, gpt2):
        out = TransformersEngine(m, PAD, []).generate(PROMPTS, SamplingParams(max_new_tokens=10, do_sample=False))
        assert torch.equal(out.responses, hf_greedy(m, PROMPTS, 10, None)), type(m).__name__


def teacher_forced_logprobs(model, prompts, out, temperature, kept=None):
    """log_softmax(logits / T) at the sampled tokens from one forward over prompt + response; with `kept`
    ([batch, len, k], -1 padded), the softmax over each position's kept ids alone."""
    ids, mask = left_padded(prompts)
    ids, mask = ids.to(out.responses.device), mask.to(out.responses.device)
    full_mask = torch.cat([mask, out.response_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, out.responses], 1), attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    logits = logits[:, ids.shape[1] - 1:-1] / temperature
    if kept is not None:
        kept = kept.to(logits.device)
        keep = torch.zeros(*logits.shape[:2], logits.shape[-1] + 1, dtype=torch.bool, device=logits.device)
        keep.scatter_(-1, kept.masked_fill(kept < 0, logits.shape[-1]), True)
        logits = logits.masked_fill(~(keep[..., :-1] | (kept < 0).all(-1, keepdim=True)), float("-inf"))
    return logits.log_softmax(-1).gather(-1, out.responses[..., None])[..., 0] * out.response_mask


def test_logprobs_match_teacher_forced_forward(model, path):
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9)
    out = TransformersEngine(model, PAD, [2, 3]).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    assert "eos" in out.stop_reasons  # some rows are padded
    assert out.kept.shape[:2] == out.responses.shape and out.kept.shape[2] <= 20
    assert (out.kept == out.responses[..., None]).any(-1)[out.response_mask.bool()].all()  # each token in its set
    torch.testing.assert_close(out.logprobs, teacher_forced_logprobs(model, PROMPTS, out, 0.7, out.kept),
                               atol=1e-4, rtol=0)
    # over the whole vocabulary the same tokens are less likely: the kept mass, which the trainer must not see
    assert (teacher_forced_logprobs(model, PROMPTS, out, 0.7) < out.logprobs - 1e-3)[out.response_mask.bool()].any()


def test_no_filter_returns_no_kept_set(model):
    out = TransformersEngine(model, PAD, [2, 3]).generate(PROMPTS, SamplingParams(max_new_tokens=6),
                                                          torch.Generator().manual_seed(3))
    assert out.kept is None
    torch.testing.assert_close(out.logprobs, teacher_forced_logprobs(model, PROMPTS, out, 1.0), atol=1e-4, rtol=0)


def test_both_paths_draw_the_same_samples(model, monkeypatch):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95)
    runs = {}
    for fast in (True, False):
        monkeypatch.setattr(rollout_engine, "_is_llama_layout", lambda config: fast)
        runs[fast] = TransformersEngine(model, PAD, [2]).generate(PROMPTS, params, torch.Generator().manual_seed(7))
    assert torch.equal(runs[True].responses, runs[False].responses)
    torch.testing.assert_close(runs[True].logprobs, runs[False].logprobs, atol=1e-5, rtol=0)


def test_max_new_tokens_and_early_stop_of_the_whole_batch(model):
    engine = TransformersEngine(model, PAD, [])
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0))
    assert out.responses.shape == (6, 5) and out.response_mask.all() and out.stop_reasons == ["length"] * 6
    # every token is an EOS: every row stops after one token and the loop ends there
    out = TransformersEngine(model, PAD, list(range(64))).generate(PROMPTS, SamplingParams(max_new_tokens=50))
    assert out.responses.shape == (6, 1) and out.stop_reasons == ["eos"] * 6


def test_eos_equal_to_pad(model):
    free = hf_greedy(model, PROMPTS, 8, None)
    eos = free[0, 2].item()  # row 0 ends at step 3 at the latest
    out = TransformersEngine(model, eos, [eos]).generate(PROMPTS, SamplingParams(max_new_tokens=8, do_sample=False))
    n = int(out.response_mask[0].sum())
    assert out.stop_reasons[0] == "eos" and n <= 3 and out.responses[0, n - 1] == eos
    assert out.response_mask[0, n:].sum() == 0


def test_same_seed_same_samples(model):
    engine = TransformersEngine(model, PAD, [2])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=30)
    a, b, c = (engine.generate(PROMPTS, params, torch.Generator().manual_seed(s)) for s in (11, 11, 12))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses, c.responses)


def test_abort_from_another_thread_keeps_tokens_so_far(model):
    engine = TransformersEngine(model, PAD, [])
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.generate(
        [[5, 6], [7]], SamplingParams(max_new_tokens=5000), torch.Generator().manual_seed(0))))
    worker.start()
    while worker.is_alive():  # keep asking: an abort() before generate starts is (rightly) forgotten
        engine.abort()
        worker.join(0.01)
    out = result["out"]
    assert out.stop_reasons == ["aborted", "aborted"]
    assert 1 <= out.responses.shape[1] < 5000 and out.response_mask.all() and (out.logprobs < 0).all()
    # an abort while idle does not cut the next call short
    engine.abort()
    assert engine.generate([[5]], SamplingParams(max_new_tokens=4)).stop_reasons == ["length"]


def test_load_weights_in_place_matches_second_model(model):
    a, b = qwen(seed=1), qwen(seed=2)
    greedy = SamplingParams(max_new_tokens=10, do_sample=False)
    engine = TransformersEngine(a, PAD, [])
    expected = TransformersEngine(b, PAD, []).generate(PROMPTS, greedy)
    assert not torch.equal(engine.generate(PROMPTS, greedy).responses, expected.responses)
    pointers = [p.data_ptr() for p in a.parameters()]
    engine.load_weights(b.state_dict())
    assert [p.data_ptr() for p in a.parameters()] == pointers
    assert torch.equal(engine.generate(PROMPTS, greedy).responses, expected.responses)
    # tied embeddings: the embedding alone also moves the output head
    emb = qwen(seed=3).model.embed_tokens.weight.detach()
    engine.load_weights({"model.embed_tokens.weight": emb})
    assert torch.equal(a.lm_head.weight, emb)
    with pytest.raises(KeyError, match="nope"):
        engine.load_weights({"nope": emb})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"model.embed_tokens.weight": emb[:3]})


def test_responses_can_feed_a_forward_with_grad(model):
    out = TransformersEngine(model, PAD, []).generate(PROMPTS, SamplingParams(max_new_tokens=4))
    trained = qwen(seed=4)
    trained(input_ids=out.responses).logits.logsumexp(-1).sum().backward()
    assert not out.responses.is_inference() and not out.logprobs.is_inference()
    assert trained.model.embed_tokens.weight.grad is not None


def test_sample_tokens_filters_and_gives_logprobs_over_the_kept_set():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]]).expand(40000, -1)
    gen = torch.Generator().manual_seed(0)

    def freqs(**kw):
        params = SamplingParams(max_new_tokens=1, **kw)
        tok, logp, kept = sample_tokens(logits, params, gen)
        z = logits / params.temperature
        if kept is not None:  # the distribution drawn from: softmax over the kept ids alone
            assert (kept == tok[:, None]).any(-1).all()
            outside = torch.ones_like(z, dtype=torch.bool).scatter_(1, kept.clamp(min=0), False)
            z = z.masked_fill(outside, float("-inf"))
        else:
            assert not kw.get("top_k", 0) > 0 and kw.get("top_p", 1) == 1
        torch.testing.assert_close(logp, z.log_softmax(-1).gather(-1, tok[:, None])[:, 0])
        return torch.bincount(tok, minlength=5).float() / len(tok)

    probs = (logits[0] / 0.5).softmax(-1)
    torch.testing.assert_close(freqs(temperature=0.5), probs, atol=0.01, rtol=0)
    p = logits[0].softmax(-1)
    top2 = torch.cat([p[:2] / p[:2].sum(), torch.zeros(3)])
    torch.testing.assert_close(freqs(top_k=2), top2, atol=0.01, rtol=0)
    # top-p keeps the fewest tokens reaching the mass: p[:2].sum() == 0.744 here
    torch.testing.assert_close(freqs(top_p=0.7), top2, atol=0.01, rtol=0)
    top3 = freqs(top_p=0.75)
    assert (top3[:3] > 0).all() and top3[3:].sum() == 0
    assert freqs(top_k=1)[0] == 1 and freqs(do_sample=False)[0] == 1
    _, logp, kept = sample_tokens(logits[:3], SamplingParams(max_new_tokens=1, top_k=1), gen)
    assert logp.eq(0).all() and kept.tolist() == [[0]] * 3  # one kept token: it was certain


def test_sampling_params_are_validated():
    for bad in (dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**{"max_new_tokens": 4, **bad})
    with pytest.raises(ValueError, match="empty"):
        TransformersEngine(qwen(), PAD, []).generate([[1], []], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_runs_where_the_model_is(device):
    m = qwen().to(device)
    ids, mask = left_padded(PROMPTS)
    ref = m.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=12, do_sample=False,
                     eos_token_id=None, pad_token_id=PAD)[:, ids.shape[1]:]
    engine = TransformersEngine(m, PAD, [])
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, do_sample=False))
    assert out.responses.device == ref.device and torch.equal(out.responses, ref)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20)
    for gen in (torch.Generator().manual_seed(0), torch.Generator(device).manual_seed(0)):  # CPU or model device
        out = engine.generate(PROMPTS, params, gen)
        torch.testing.assert_close(out.logprobs, teacher_forced_logprobs(m, PROMPTS, out, 0.7, out.kept.cpu()),
                                   atol=1e-4, rtol=0)


def test_load_weights_shared_reads_the_source_tensors_without_copies():
    """share=True: same dtype and device alias the source (later in-place changes show up in the
    engine); another dtype is still copied."""
    a, b = qwen(seed=1), qwen(seed=2)
    greedy = SamplingParams(max_new_tokens=10, do_sample=False)
    engine = TransformersEngine(a, PAD, [])
    source = {k: v.detach() for k, v in b.state_dict().items()}
    engine.load_weights(source, share=True)
    assert all(p.data_ptr() == source[k].data_ptr() for k, p in a.named_parameters())
    with torch.no_grad():  # an optimizer step on the source model...
        for p in b.parameters():
            p.mul_(1.5)
    expected = TransformersEngine(b, PAD, []).generate(PROMPTS, greedy)
    assert torch.equal(engine.generate(PROMPTS, greedy).responses, expected.responses)  # ...is seen
    half = qwen(seed=3).to(torch.bfloat16)
    before = {k: p.data_ptr() for k, p in half.named_parameters()}
    TransformersEngine(half, PAD, []).load_weights(source, share=True)
    assert {k: p.data_ptr() for k, p in half.named_parameters()} == before  # bf16 <- fp32: copied
    assert torch.equal(half.lm_head.weight, source["lm_head.weight"].to(torch.bfloat16))
