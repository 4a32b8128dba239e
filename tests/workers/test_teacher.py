"""The distillation teacher role and the student's side of the top-k loss, on tiny real models: each row goes
to the teacher its routing value names and gets that model's log-probs (at temperature 1 whatever the student
samples at); the top-k ids and log-probs are the full distribution's; the student's log-probs at the teacher's
ids and their gradients equal the full-vocabulary path's, padded and packed."""

import pytest
import torch

from plait.models import create_tiny_model, load_causal_lm
from plait.profiler import ProfilerSession, RoleProfilerConfig
from plait.profiler.config import GlobalProfilerConfig
from plait.workers.logprobs import response_logprobs, response_topk, response_topk_stats
from plait.workers.teacher import Route, Teacher, TeacherSpec

from tests.workers.test_packing import make_batch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {seed: create_tiny_model(root / f"m{seed}", size="xs", seed=seed) for seed in (1, 2)}


def profiler():
    return ProfilerSession(GlobalProfilerConfig(), {"teacher": RoleProfilerConfig()}, rank=0).for_role("teacher")


def full_logp(model, batch):
    """log softmax over the whole vocabulary at the positions scoring each response token [batch, resp_len, vocab]."""
    resp = batch.responses.shape[1]
    mask = batch.attention_mask
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return torch.log_softmax(logits[:, -resp - 1:-1].float(), -1)


def test_rows_go_to_the_teacher_their_data_source_names(models):
    batch = make_batch(rows=6, seed=3)
    batch.data_sources = ["math", "code", "math", "code", "code", "math"]
    teacher = Teacher({"math": TeacherSpec(models[1], "m1"), "code": TeacherSpec(models[2], "m2")}, 0,
                      Route(None, None), profiler())
    logp, ids = teacher.compute_teacher_log_prob(batch)
    assert ids is None and logp.shape == batch.responses.shape
    mask = batch.response_mask.bool()
    for seed, source in ((1, "math"), (2, "code")):
        model = load_causal_lm(models[seed])
        want = full_logp(model, batch).gather(-1, batch.responses[..., None]).squeeze(-1)
        rows = [i for i, s in enumerate(batch.data_sources) if s == source]
        torch.testing.assert_close(logp[rows][mask[rows]], want[rows][mask[rows]], atol=1e-5, rtol=1e-5)
        other = [i for i in range(6) if i not in rows]
        assert not torch.allclose(logp[other][mask[other]], want[other][mask[other]], atol=1e-3)  # not the other's
    assert (logp[~mask] == 0).all()


def test_an_extra_info_column_routes_and_one_teacher_takes_every_row(models):
    batch = make_batch(rows=4, seed=4)
    batch.extra_infos = [{"task": t} for t in ("x", 2, "y", None)]
    assert Route("task", None).keys(batch) == ["x", "2", "y", None]  # a config key is a string: 2 routes to "2"
    assert Route(None, "default").keys(batch) == ["default"] * 4


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_top_k_is_the_full_distributions(models, packed):
    batch = make_batch(rows=5, seed=5)
    model = load_causal_lm(models[1])
    with torch.no_grad():
        logp, ids = response_topk(model, batch.input_ids, batch.attention_mask, batch.responses.shape[1], 4, packed)
    want = full_logp(model, batch).topk(4, -1)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(logp[mask], want.values[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(ids[mask], want.indices[mask])
    teacher = Teacher({"default": TeacherSpec(models[1], "m1", max_tokens=20)}, 4, Route(None, "default"), profiler(),
                      remove_padding=packed)  # a 20-token budget: several forwards, rows longer than it alone
    t_logp, t_ids = teacher.compute_teacher_log_prob(batch)
    torch.testing.assert_close(t_logp[mask], want.values[mask], atol=1e-5, rtol=1e-5)
    assert t_ids.dtype == torch.long and torch.equal(t_ids[mask], want.indices[mask])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_students_top_k_gather_and_its_gradients_are_the_full_paths(models, packed):
    batch = make_batch(rows=5, seed=6)
    g = torch.Generator().manual_seed(0)
    model = load_causal_lm(models[2])
    vocab, T = model.config.vocab_size, 0.7
    ids = torch.randint(0, vocab, (*batch.responses.shape, 3), generator=g)
    w = torch.randn(*batch.responses.shape, 3, generator=g)
    mask = batch.response_mask.bool()

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}
    logp, ent, at_ids, top = response_topk_stats(model, batch.input_ids, batch.attention_mask, batch.responses.shape[1],
                                                 T, True, ids, packed)
    ours = grads((at_ids * w)[mask].sum() + logp[mask].sum())
    resp, am = batch.responses.shape[1], batch.attention_mask
    logits = model(input_ids=batch.input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    full = torch.log_softmax(logits[:, -resp - 1:-1].float() / T, -1)
    want_ids, want_logp = full.gather(-1, ids), full.gather(-1, batch.responses[..., None]).squeeze(-1)
    theirs = grads((want_ids * w)[mask].sum() + want_logp[mask].sum())
    torch.testing.assert_close(at_ids[mask], want_ids[mask].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp[mask], want_logp[mask].detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(top[mask], full.topk(3, -1).indices[mask])
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], atol=2e-5, rtol=1e-3, msg=k)
    with torch.no_grad():  # the plain path's log-probs and entropy: the top-k gather does not change them
        plain = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.responses.shape[1], T, True, packed)
    torch.testing.assert_close(logp.detach(), plain[0])
    torch.testing.assert_close(ent.detach(), plain[1])
