"""On-policy distillation's loss equal to verl 0.9.1's, value and gradients, on the same tensors.

verl's side runs in a subprocess that imports the installed wheel (`verl.trainer.distillation.losses`:
`distillation_ppo_loss`, and the FSDP engine's `compute_forward_kl_topk` for the top-k loss) on verl's
unpadded layout (one flat row of every sequence's tokens, a position's output scoring the next token,
teacher top-k as nested tensors); plait's side is plait.algorithms.distillation on the padded
[batch, resp_len] tensors, put together as the actor puts it (plait/workers/actor.py). Compared: the
loss, its gradients with respect to the log-probs (and the student's logits for the top-k loss) and the
distillation/* metrics.

    pip download verl==0.9.1 --no-deps && unzip the wheel into DIR   (or .ci/run's .verl-side)
    PLAIT_VERL_SITE=DIR pytest tests/algorithms/test_verl091_distillation.py

Without PLAIT_VERL_SITE the tests skip, naming it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.distillation import (DistillationKnobs, distillation_loss, estimator_losses, forward_kl_topk,
                                           topk_metrics, total_loss)
from plait.algorithms.losses import agg_loss, ppo_policy_loss

VERL_SITE = os.environ.get("PLAIT_VERL_SITE")
pytestmark = pytest.mark.skipif(not VERL_SITE or not (Path(VERL_SITE) / "verl" / "trainer" / "distillation").is_dir(),
                                reason="verl 0.9.1 side directory not given: set PLAIT_VERL_SITE (see this file's docstring)")

PROMPT_LENS, RESP_LENS, K, VOCAB = [2, 3, 1], [4, 2, 3], 3, 11

VERL_SIDE = r'''
import sys
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig
from verl.trainer.distillation.losses import distillation_ppo_loss
from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk

def run(inp):
    case = inp["case"]
    loss_cfg = DistillationLossConfig(loss_mode=case["loss_mode"], topk=inp["k"], use_task_rewards=case["use_task_rewards"],
                                      distillation_loss_coef=case["coef"], loss_max_clamp=case["loss_max_clamp"],
                                      log_prob_min_clamp=case["log_prob_min_clamp"],
                                      use_policy_gradient=case["use_policy_gradient"], clip_ratio=0.2,
                                      clip_ratio_low=case["clip_low"], clip_ratio_high=case["clip_high"])
    dcfg = DistillationConfig(enabled=False, distillation_loss=loss_cfg)
    actor = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1,
                            loss_agg_mode=case["agg_mode"], entropy_coeff=case["entropy_coeff"], clip_ratio=0.2,
                            clip_ratio_low=0.2, clip_ratio_high=0.28, loss_scale_factor=case["loss_scale_factor"])
    log_probs = inp["flat_logp"].clone().requires_grad_()
    model_output = {"log_probs": log_probs, "entropy": inp["flat_entropy"]}
    data = TensorDict({"prompts": inp["prompts"], "responses": inp["responses"], "attention_mask": inp["attention_mask"],
                       "response_mask": inp["response_mask"], "old_log_probs": inp["old_logp"],
                       "advantages": inp["advantages"]}, batch_size=len(inp["prompts"]))
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=inp["num_tokens"], global_batch_size=inp["num_seqs"])
    logits = None
    nest = lambda parts: torch.nested.nested_tensor(parts, layout=torch.jagged)
    if case["loss_mode"] == "forward_kl_topk":
        logits = inp["flat_logits"].clone().requires_grad_()
        teacher_logp, teacher_ids = nest(inp["teacher_topk_logp"]), nest(inp["teacher_topk_ids"])
        data["teacher_logprobs"], data["teacher_ids"] = teacher_logp, teacher_ids
        out = compute_forward_kl_topk(logits, teacher_logp, teacher_ids, dcfg, "thd")
        model_output.update({k: v.squeeze(0) for k, v in out.items()})
    else:
        data["teacher_logprobs"] = nest(list(inp["flat_teacher_logp"].split(inp["seq_lens"])))
    loss, metrics = distillation_ppo_loss(actor, dcfg, model_output, data)
    loss.backward()
    plain = {k: float(v.aggregate() if hasattr(v, "aggregate") else v) for k, v in metrics.items()}
    return {"loss": loss.detach(), "grad_logp": log_probs.grad, "grad_logits": None if logits is None else logits.grad,
            "metrics": plain}

torch.save({name: run(inp) for name, inp in torch.load(sys.argv[1]).items()}, sys.argv[2])
'''


def layout(seed: int = 0) -> dict:
    """Random padded tensors and verl's flat layout of the same values."""
    g = torch.Generator().manual_seed(seed)
    rows, plen, rlen = len(PROMPT_LENS), max(PROMPT_LENS), max(RESP_LENS)
    prompt_mask = torch.tensor([[0] * (plen - p) + [1] * p for p in PROMPT_LENS])
    attended = torch.tensor([[1] * r + [0] * (rlen - r) for r in RESP_LENS])
    response_mask = attended.clone().float()
    response_mask[0, 1] = 0.0                                   # a masked token inside a response (a tool message)
    logp = -torch.rand(rows, rlen, generator=g, dtype=torch.float64) * 3 * attended
    teacher = -torch.rand(rows, rlen, generator=g, dtype=torch.float64) * 3 * attended
    old = (logp + 0.3 * torch.randn(rows, rlen, generator=g, dtype=torch.float64)) * attended
    entropy = torch.rand(rows, rlen, generator=g, dtype=torch.float64) * attended
    logits = torch.randn(rows, rlen, VOCAB, generator=g, dtype=torch.float64) * 2
    t_logits = torch.randn(rows, rlen, VOCAB, generator=g, dtype=torch.float64) * 2
    t_logp, t_ids = torch.log_softmax(t_logits, -1).topk(K, -1)  # [rows, rlen, K]
    total = sum(PROMPT_LENS) + sum(RESP_LENS)
    flat = {name: torch.zeros(total, *shape, dtype=dtype) for name, shape, dtype in (
        ("logp", (), torch.float64), ("teacher_logp", (1,), torch.float64), ("entropy", (), torch.float64),
        ("logits", (VOCAB,), torch.float64))}
    flat["logits"] = torch.randn(total, VOCAB, generator=g, dtype=torch.float64)  # prompt positions: any values
    nested_logp, nested_ids, start = [], [], 0
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        at = slice(start + p - 1, start + p - 1 + r)             # the positions whose outputs score response tokens
        flat["logp"][at], flat["teacher_logp"][at, 0], flat["entropy"][at] = logp[i, :r], teacher[i, :r], entropy[i, :r]
        flat["logits"][at] = logits[i, :r]
        seq_logp = torch.log_softmax(torch.randn(p + r, VOCAB, generator=g, dtype=torch.float64), -1).topk(K, -1)
        seq_logp, seq_ids = seq_logp.values.clone(), seq_logp.indices.clone()
        seq_logp[p - 1:p - 1 + r], seq_ids[p - 1:p - 1 + r] = t_logp[i, :r], t_ids[i, :r]
        nested_logp.append(seq_logp), nested_ids.append(seq_ids)
        start += p + r
    return {"padded": dict(response_mask=response_mask, logp=logp, teacher=teacher, old=old, entropy=entropy,
                           logits=logits, t_logp=t_logp, t_ids=t_ids),
            "verl": {"prompts": torch.ones(rows, plen, dtype=torch.long), "responses": torch.ones(rows, rlen, dtype=torch.long),
                     "attention_mask": torch.cat([prompt_mask, attended], 1), "response_mask": response_mask,
                     "old_log_probs": old, "flat_logp": flat["logp"], "flat_teacher_logp": flat["teacher_logp"],
                     "flat_entropy": flat["entropy"], "flat_logits": flat["logits"].unsqueeze(0),
                     "teacher_topk_logp": nested_logp, "teacher_topk_ids": nested_ids}}


def verl_inputs(case: dict, t: dict) -> dict:
    v = dict(t["verl"])
    mask = v["response_mask"]
    return {**v, "old_logp": v.pop("old_log_probs"), "case": case, "k": K, "advantages": case["advantages"],
            "num_tokens": mask.sum().item(), "num_seqs": len(mask), "seq_lens": [p + r for p, r in zip(PROMPT_LENS, RESP_LENS)]}


@pytest.fixture(scope="module")
def verl_results(tmp_path_factory):
    """Every case through verl in one subprocess (importing verl takes seconds)."""
    folder = tmp_path_factory.mktemp("verl")
    torch.save({name: verl_inputs(*inputs(name)) for name in CASES}, folder / "in.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([VERL_SITE, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", VERL_SIDE, str(folder / "in.pt"), str(folder / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt")


def run_plait(case: dict, t: dict) -> dict:
    """The actor's composition (plait/workers/actor.py _optimizer_step): policy loss, entropy bonus, then
    the distillation loss of the same micro-batch, combined by total_loss."""
    p = t["padded"]
    mask = p["response_mask"]
    knobs = DistillationKnobs(loss_mode=case["loss_mode"], use_task_rewards=case["use_task_rewards"], coef=case["coef"],
                              loss_max_clamp=case["loss_max_clamp"], log_prob_min_clamp=case["log_prob_min_clamp"],
                              use_policy_gradient=case["use_policy_gradient"], clip_low=case["clip_low"],
                              clip_high=case["clip_high"])
    norm = dict(num_tokens=mask.sum().item(), num_seqs=len(mask), loss_scale_factor=case["loss_scale_factor"])
    logp = p["logp"].clone().requires_grad_()
    logits = p["logits"].clone().requires_grad_()
    pg, _ = ppo_policy_loss(logp, p["old"], case["advantages"], mask, 0.2, 0.28, 3.0, case["agg_mode"], **norm)
    policy = pg - case["entropy_coeff"] * agg_loss(p["entropy"], mask, case["agg_mode"], **norm)
    extra_means = extra_ext = {}
    if knobs.topk:
        student = torch.log_softmax(logits, -1)
        losses, aux = forward_kl_topk(student.gather(-1, p["t_ids"]), p["t_logp"], p["t_ids"], student.topk(K, -1).indices,
                                      knobs.log_prob_min_clamp)
        extra_means, extra_ext = topk_metrics(aux, mask, K)
    else:
        losses = estimator_losses(knobs.loss_mode, logp, p["teacher"])
    distill, means, extremes = distillation_loss(knobs, losses, logp, p["old"], mask, case["agg_mode"], **norm)
    loss = total_loss(policy, distill, knobs)
    loss.backward()
    return {"loss": loss.detach(), "grad_logp": logp.grad, "grad_logits": logits.grad if knobs.topk else None,
            "metrics": {**means, **extremes, **extra_means, **extra_ext, "distillation/loss": distill.item()}}


def case(loss_mode: str, **changes) -> dict:
    base = dict(loss_mode=loss_mode, use_task_rewards=True, coef=1.0, loss_max_clamp=None, log_prob_min_clamp=None,
                use_policy_gradient=False, clip_low=0.2, clip_high=0.2, agg_mode="token-mean", entropy_coeff=0.0,
                loss_scale_factor=None)
    return {**base, **changes}


CASES = {
    "k3_supervised_with_task_rewards": case("k3", coef=0.5, entropy_coeff=0.01, loss_max_clamp=10.0),
    "k1_policy_gradient_alone": case("k1", use_task_rewards=False, use_policy_gradient=True, loss_max_clamp=0.5),
    "k1_policy_gradient_with_task_rewards": case("k1", use_policy_gradient=True, coef=2.0, clip_low=0.1, clip_high=0.3),
    "k2_seq_mean_token_mean": case("k2", use_task_rewards=False, agg_mode="seq-mean-token-mean"),
    "low_var_kl_token_sum": case("low_var_kl", agg_mode="token-sum", loss_max_clamp=0.3),
    "abs_seq_mean_token_sum_norm": case("abs", agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7),
    "kl_policy_gradient": case("kl", use_task_rewards=False, use_policy_gradient=True),
    "mse": case("mse", entropy_coeff=0.1),
    "forward_kl_topk_supervised": case("forward_kl_topk", use_task_rewards=False, log_prob_min_clamp=-2.0),
    "forward_kl_topk_with_task_rewards": case("forward_kl_topk", coef=0.3, loss_max_clamp=0.8, entropy_coeff=0.01),
    "forward_kl_topk_policy_gradient": case("forward_kl_topk", use_task_rewards=False, use_policy_gradient=True,
                                            log_prob_min_clamp=-1.5),
}


def inputs(name: str) -> tuple[dict, dict]:
    """A case's knobs with its advantages, and its tensors."""
    advantages = torch.randn(len(PROMPT_LENS), max(RESP_LENS), dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    return {**CASES[name], "advantages": advantages}, layout(seed=len(name))


@pytest.mark.parametrize("name", list(CASES))
def test_distillation_loss_equals_verls(verl_results, name):
    c, t = inputs(name)
    theirs, ours = verl_results[name], run_plait(c, t)
    assert_close(ours["loss"].double(), theirs["loss"].double(), rtol=1e-6, atol=1e-9)  # top-k: float32 in both
    flat_grad = theirs["grad_logp"]  # verl's gradient on the flat layout, back to [batch, resp_len]; None: unused
    assert (flat_grad is None) == (ours["grad_logp"] is None)
    start = 0
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        at = slice(start + p - 1, start + p - 1 + r)
        if flat_grad is not None:
            assert_close(ours["grad_logp"][i, :r], flat_grad[at], rtol=1e-6, atol=1e-9)
            assert not ours["grad_logp"][i, r:].any()
        if theirs["grad_logits"] is not None:
            assert_close(ours["grad_logits"][i, :r], theirs["grad_logits"][0, at], rtol=1e-6, atol=1e-9)
        start += p + r
    assert (theirs["grad_logits"] is None) == (ours["grad_logits"] is None)
    assert ours["grad_logits"] is not None or not (c["loss_mode"] == "forward_kl_topk" and not c["use_policy_gradient"])
    for key, value in theirs["metrics"].items():
        if key.startswith("distillation/"):
            assert ours["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert {k for k in theirs["metrics"] if k.startswith("distillation/")} == set(ours["metrics"])
