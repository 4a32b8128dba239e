"""A VL policy's update gradient equals the supervised one: plait's policy loss over rollout-layout rows
(left-padded prompt | right-padded response, padded or packed), advantage 1 on some rows and 0 on the others,
gives the same gradient, in the language model AND the vision tower, as transformers' own next-token loss on
those rows alone (right-padded, labels on the answer). Rows' images out of line would break the equality."""

import pytest
import torch

from plait.algorithms.losses import PolicyLossKnobs, policy_loss
from plait.models import create_tiny_vl_model, load_causal_lm
from plait.models_vl import load_processor
from plait.vl_demo import format_examples, format_loss
from plait.workers.logprobs import response_logprobs

torch.set_num_threads(1)
RESP = 6


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = create_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model", "qwen2_vl", seed=0)
    processor = load_processor(path)
    return load_causal_lm(path).train(), processor, format_examples(processor, "larger_shape", 6, 0, labels="true")


def rollout_rows(examples, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, attention [rows, prompt + RESP]: each example's prompt left-padded, its answer right-padded."""
    width = max(e["mask"].index(1) for e in examples)
    ids = torch.full((len(examples), width + RESP), pad)
    attention = torch.zeros_like(ids)
    for b, e in enumerate(examples):
        k = e["mask"].index(1)
        ids[b, width - k:width + len(e["ids"]) - k] = torch.tensor(e["ids"])
        attention[b, width - k:width + len(e["ids"]) - k] = 1
    return ids, attention


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("remove_padding", [False, True])
def test_policy_gradient_is_the_supervised_one(demo, remove_padding):
    model, processor, examples = demo
    pad = processor.tokenizer.pad_token_id
    chosen = [0, 2, 3]                                                      # advantage 1; the others 0
    format_loss(model, [examples[i] for i in chosen], pad).backward()
    want = grads(model)
    ids, attention = rollout_rows(examples, pad)
    logp, _ = response_logprobs(model, ids, attention, RESP, 1.0, False, remove_padding,
                                [e["inputs"] for e in examples])            # [rows, RESP]
    mask = attention[:, -RESP:].float()
    adv = torch.zeros(len(examples), RESP)
    adv[chosen] = 1.0
    loss, _ = policy_loss("vanilla", logp, logp.detach(), adv, mask, PolicyLossKnobs(),
                          num_tokens=mask[chosen].sum().item(), num_seqs=len(examples))
    loss.backward()
    got = grads(model)
    for part in ("model.visual.", "model.language_model."):
        names = [n for n in want if n.startswith(part)]
        a, b = (torch.cat([g[n].flatten() for n in names]) for g in (want, got))
        assert len(names) > 0 and a.norm() > 0
        # not bit-equal: plait gives the image pad tokens no probability (models_vl.never_sampled), HF does
        assert torch.nn.functional.cosine_similarity(a, b, 0) > 0.999, part
        assert (a - b).norm() / a.norm() < 0.02, part
