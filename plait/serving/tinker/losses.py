"""The Tinker API's built-in losses, as the SDK documents them: pure functions of one datum's per-token tensors.

Each takes `logp` (the trained model's log-prob of each target token, [n]), the datum's `loss_fn_inputs` as
tensors ([n] each) and the request's `loss_fn_config`, and returns the element-wise loss [n]; a datum's loss is
its sum (Tinker sums over tokens and data; it never averages, so weights or advantages carry any scaling).

    cross_entropy        -weights * logp
    importance_sampling  -exp(logp - logprobs) * advantages                     (logprobs: the sampler's)
    ppo                  -min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A),  r = exp(logp - logprobs)
    cispo                -sg(clip(r, low, high)) * logp * A                      (sg: no gradient through it)
    dro                  -(logp * A - beta / 2 * (logp - logprobs)^2)

Left out: gspo (sequence-level ratios); stable_reinforce, which SDK 0.38 names (LossFnType, a `kl_coeff` config, a
sampler's `record_stability_info` read back by `sequence_id`) but does not define: no formula to be equal to; `custom`
(the SDK runs its custom losses client-side through cross_entropy's weights, which needs nothing here).
"""

from __future__ import annotations

import torch
from torch import Tensor

CLIP_LOW, CLIP_HIGH = 0.8, 1.2  # ppo's and cispo's ratio bounds when loss_fn_config names none


def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    weights = inputs.get("weights", torch.ones_like(logp))
    return -weights * logp


def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    return -torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]


def ppo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = ratio.clamp(config.get("clip_low_threshold", CLIP_LOW), config.get("clip_high_threshold", CLIP_HIGH))
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    clipped = ratio.clamp(config.get("clip_low_threshold", CLIP_LOW), config.get("clip_high_threshold", CLIP_HIGH))
    return -clipped * logp * inputs["advantages"]


def dro(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> Tensor:
    return -(logp * inputs["advantages"] - config["beta"] / 2 * (logp - inputs["logprobs"]) ** 2)


RL_INPUTS = ("target_tokens", "logprobs", "advantages")

# name -> (loss, the loss_fn_inputs it needs, the loss_fn_config keys it reads (required ones marked by None default))
LOSSES = {
    "cross_entropy": (cross_entropy, ("target_tokens",), {}),
    "importance_sampling": (importance_sampling, RL_INPUTS, {}),
    "ppo": (ppo, RL_INPUTS, {"clip_low_threshold": CLIP_LOW, "clip_high_threshold": CLIP_HIGH}),
    "cispo": (cispo, RL_INPUTS, {"clip_low_threshold": CLIP_LOW, "clip_high_threshold": CLIP_HIGH}),
    "dro": (dro, RL_INPUTS, {"beta": None}),
}
OPTIONAL_INPUTS = {"weights"}  # cross_entropy's, ones when absent
# losses the SDK names that are not served, and why (the refusal says it)
UNSERVED = {"stable_reinforce": "the tinker SDK (0.38) names it but does not define it (its kl_coeff and the "
                                "sampler's stability records have no published formula), so there is nothing to be "
                                "equal to"}
