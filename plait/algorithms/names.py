"""What the algorithms are called: the names config.py validates against, without importing torch.

Each table in advantages.py, kl.py and losses.py is keyed by exactly these names (it asserts so at
import), so a config error is reported before torch loads and the names still live in one place.
"""

from __future__ import annotations

ESTIMATOR_NAMES = ("grpo", "grpo_passk", "rloo", "grpo_vectorized", "rloo_vectorized", "reinforce_plus_plus",
                   "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "gae", "gdpo", "optimal_token_baseline",
                   "tir_optimal_token_baseline")
KL_ESTIMATOR_NAMES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k2+", "mse+", "kl+", "abs+", "k3+",
                      "low_var_kl+")
POLICY_LOSS_NAMES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "sapo", "cispo", "dppo_tv", "dppo_kl",
                     "dro")
# on-policy distillation (distillation.py): verl 0.9.1's registry, its estimators first
DISTILLATION_ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
DISTILLATION_TOPK_MODES = ("forward_kl_topk",)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# rollout correction (rollout_correction.py)
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def parse_is_threshold(threshold: float | str) -> tuple[float, float | None]:
    """(upper, lower or None) of `rollout_is_threshold`: a number u truncates weights at u (TIS); a
    "lower_upper" string keeps weights in [lower, upper] and zeroes the others (IcePop)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError("a number (truncation) or a 'lower_upper' string (IcePop)")
    lower_text, _, upper_text = str(threshold).strip().rpartition("_") if isinstance(threshold, str) else ("", "", threshold)
    try:
        upper, lower = float(upper_text), float(lower_text) if lower_text else None
    except ValueError:
        raise ValueError("a number (truncation) or a 'lower_upper' string (IcePop), e.g. 2.0 or '0.5_5.0'") from None
    if not 0 < upper < float("inf") or (lower is not None and not 0 < lower <= upper):
        raise ValueError("bounds must be finite and > 0 with lower <= upper (rollout_is: null turns weighting off)")
    return upper, lower


def parse_rs(rollout_rs: str, threshold: str | float | None) -> list[tuple[str, float, float | None]]:
    """(option, upper, lower or None) per check of `rollout_rs` and `rollout_rs_threshold`."""
    options = [RS_ALIASES.get(o.strip(), o.strip()) for o in rollout_rs.split(",") if o.strip()]
    for o in options:
        if o not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {o!r}; valid: {', '.join(RS_OPTIONS + tuple(RS_ALIASES))}")
    if threshold is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={threshold!r}: give one threshold or one per rollout_rs option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    checks = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            lower, _, upper = spec.rpartition("_")
            upper_v = float(upper)
            lower_v = float(lower) if lower else 1.0 / upper_v
            if lower_v <= 0 or upper_v <= 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: bounds must be > 0")
            checks.append((option, upper_v, lower_v))
        else:
            if float(spec) <= 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: must be > 0")
            checks.append((option, float(spec), None))
    return checks
