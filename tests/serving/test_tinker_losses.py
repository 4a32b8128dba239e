"""The local Tinker's losses (plait/serving/tinker/losses.py) on hand-computed inputs and side by side with plait's
verl-tested policy losses (token-sum aggregation, no dual clip), and its protobuf decoding of the SDK's own
forward_backward bodies, zstd-compressed included. Pure: no server."""

import math

import pytest
import torch

from plait.algorithms.losses import PolicyLossKnobs, cispo_loss, dro_loss, ppo_policy_loss
from plait.serving.protocol import ApiError
from plait.serving.tinker import losses
from plait.serving.tinker.wire import decode_forward_backward

logp = torch.tensor([-1.0, -0.5, -2.0, -0.1])
old = torch.tensor([-1.2, -0.5, -1.0, -0.4])
adv = torch.tensor([1.0, -2.0, 0.5, -1.0])
RL = {"logprobs": old, "advantages": adv}
MASK = torch.ones(1, 4)


def test_cross_entropy_and_importance_sampling_by_hand():
    weights = torch.tensor([1.0, 0.0, 2.0, 0.5])
    assert losses.cross_entropy(logp, {"weights": weights}, {}).tolist() == pytest.approx([1.0, 0.0, 4.0, 0.05])
    assert losses.cross_entropy(logp, {}, {}).sum().item() == pytest.approx(3.6)  # weights default to ones
    expected = [-math.exp(0.2) * 1.0, 2.0, -math.exp(-1.0) * 0.5, -math.exp(0.3) * -1.0]
    assert losses.importance_sampling(logp, RL, {}).tolist() == pytest.approx(expected)


def test_ppo_equals_plaits_clipped_surrogate_with_thresholds_as_one_minus_and_one_plus_clip():
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    ours = losses.ppo(logp, RL, config).sum()
    theirs, _ = ppo_policy_loss(logp[None], old[None], adv[None], MASK, clip_low=0.1, clip_high=0.1, clip_c=1e9,
                                agg_mode="token-sum")
    assert ours.item() == pytest.approx(theirs.item())
    # by hand: token 0 (A>0, r=e^0.2>1.1) is clipped at 1.1; token 3 (A<0, r=e^0.3) keeps its larger loss r*|A|
    per_token = losses.ppo(logp, RL, config)
    assert per_token[0].item() == pytest.approx(-1.1) and per_token[3].item() == pytest.approx(math.exp(0.3))
    default = losses.ppo(logp, RL, {})  # thresholds 0.8 and 1.2 when the config names none
    assert default[0].item() == pytest.approx(-1.2)


def test_cispo_and_dro_equal_plaits_and_cispo_passes_no_gradient_through_the_ratio():
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    theirs, _ = cispo_loss(logp[None], old[None], adv[None], MASK, PolicyLossKnobs(0.2, 0.2, agg_mode="token-sum"))
    assert losses.cispo(logp, RL, config).sum().item() == pytest.approx(theirs.item())
    theirs, _ = dro_loss(logp[None], old[None], adv[None], MASK, PolicyLossKnobs(agg_mode="token-sum", dro_beta=0.3))
    assert losses.dro(logp, RL, {"beta": 0.3}).sum().item() == pytest.approx(theirs.item())
    x = logp.clone().requires_grad_(True)
    losses.cispo(x, RL, config).sum().backward()
    clipped = torch.exp(logp - old).clamp(0.8, 1.2)
    assert torch.allclose(x.grad, -clipped * adv)


def sdk_body(loss_fn="cross_entropy", compress=False, **inputs) -> bytes:
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                               loss_fn_inputs=inputs or {"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 0.0]})
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id="m", seq_id=1)
    body = forward_backward_request_to_proto(request).SerializeToString()
    if compress:
        import zstandard
        body = zstandard.ZstdCompressor().compress(body)
    return body


@pytest.mark.parametrize("compress", [False, True])
def test_the_sdks_forward_backward_body_decodes_plain_and_zstd(compress):
    req = decode_forward_backward(sdk_body(compress=compress), "zstd" if compress else None)
    assert (req.model_id, req.seq_id, req.loss_fn) == ("m", 1, "cross_entropy")
    assert req.data[0].tokens == [5, 6, 7]
    assert req.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert req.data[0].inputs["weights"].tolist() == [1.0, 1.0, 0.0]


def test_a_malformed_body_is_refused_naming_the_field():
    with pytest.raises(ApiError, match=r"data\[0\]\.loss_fn_inputs\.advantages is missing"):
        decode_forward_backward(sdk_body("ppo", target_tokens=[6, 7, 8], logprobs=[0.0, 0.0, 0.0]), None)
    with pytest.raises(ApiError, match=r"data\[0\]\.loss_fn_inputs\.bogus is not an input"):
        decode_forward_backward(sdk_body(target_tokens=[6, 7, 8], bogus=torch.tensor([1.0, 2.0, 3.0])), None)
    with pytest.raises(ApiError, match="Content-Encoding 'br'"):
        decode_forward_backward(sdk_body(), "br")
    with pytest.raises(ApiError, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff", None)


def test_stable_reinforce_is_named_by_the_sdk_but_not_defined_so_it_is_refused_saying_so():
    import typing
    tinker = pytest.importorskip("tinker")
    assert "stable_reinforce" in typing.get_args(tinker.types.LossFnType)  # if a later SDK defines it, serve it
    with pytest.raises(ApiError, match="names it but does not define it"):
        decode_forward_backward(sdk_body("stable_reinforce", target_tokens=[6, 7, 8], logprobs=[0.0] * 3,
                                         advantages=[1.0] * 3), None)
