"""What crosses role boundaries: prompts, rollouts and the outputs of each role.

A `RolloutBatch` is made by the rollout role and grows through the step: the lifecycle fills in
scores, log-probs, values and advantages as the stages run. It knows how to split itself across
data-parallel workers and join back, and nothing else; the math lives in plait/algorithms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class PromptBatch:
    """Prompts for one generation call (before the rollout repeats each one n times)."""
    prompt_ids: list[list[int]]
    data_sources: list[str]
    ground_truths: list[Any]               # as each row stores it: str, list or dict
    extra_infos: list[dict]
    indices: list[int]                     # row index in the dataset; stable ids for groups and logs
    agent_names: list = field(default_factory=list)  # a row's agent_name column (None: the default loop); []: none
    multi_modal: list[dict] = field(default_factory=list)  # per row {"images": [PIL RGB, resized per min/max_pixels],
    #   "videos": [...]}, {} for a text row; [] when no row has media. A row may instead carry its processor
    #   outputs ({"pixel_values", "image_grid_thw"}: a RolloutBatch's rows generated again, ReMax's greedy baseline)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @staticmethod
    def concat(parts: list["PromptBatch"]) -> "PromptBatch":
        """Join batches row-wise, in order."""
        media = [m for p in parts for m in (p.multi_modal or [{}] * len(p))]
        names = [x for p in parts for x in (p.agent_names or [None] * len(p))]
        join = lambda field: [x for p in parts for x in getattr(p, field)]  # noqa: E731
        return PromptBatch(prompt_ids=join("prompt_ids"), data_sources=join("data_sources"),
                           ground_truths=join("ground_truths"), extra_infos=join("extra_infos"), indices=join("indices"),
                           agent_names=names if any(n is not None for n in names) else [],
                           multi_modal=media if any(media) else [])


_OPTIONAL_TENSORS = ("token_scores", "token_rewards", "old_logprobs", "ref_logprobs", "values",
                     "advantages", "returns", "rollout_is_weights", "loss_mask", "sum_pi_squared",
                     "response_attention", "token_versions", "teacher_logprobs", "teacher_ids", "sampled_from")


@dataclass
class RolloutBatch:
    prompts: torch.Tensor                  # [batch, prompt_len] left-padded
    responses: torch.Tensor                # [batch, resp_len] right-padded
    response_mask: torch.Tensor            # [batch, resp_len] float, 1 on tokens TRAINED ON: the ones the policy sampled (EOS included)
    prompt_mask: torch.Tensor              # [batch, prompt_len] 1 on real prompt tokens
    rollout_logprobs: torch.Tensor         # [batch, resp_len] log-probs the rollout sampled with
    group_ids: torch.Tensor                # [batch] long; samples of one prompt share an id
    versions: torch.Tensor                 # [batch] long; policy version each sample was generated with
    data_sources: list[str]
    ground_truths: list[Any]               # as each row stores it: str, list or dict
    extra_infos: list[dict]
    stop_reasons: list[str]
    token_scores: Optional[torch.Tensor] = None   # [batch, resp_len] reward at the last token
    token_rewards: Optional[torch.Tensor] = None  # [batch, resp_len] scores minus in-reward KL
    old_logprobs: Optional[torch.Tensor] = None   # [batch, resp_len]
    ref_logprobs: Optional[torch.Tensor] = None   # [batch, resp_len]
    values: Optional[torch.Tensor] = None         # [batch, resp_len]
    advantages: Optional[torch.Tensor] = None     # [batch, resp_len]
    returns: Optional[torch.Tensor] = None        # [batch, resp_len]
    rollout_is_weights: Optional[torch.Tensor] = None  # [batch, resp_len] truncated IS weights (rollout correction)
    loss_mask: Optional[torch.Tensor] = None      # [batch, resp_len] response_mask less rejected samples; None: response_mask
    sum_pi_squared: Optional[torch.Tensor] = None  # [batch, resp_len] sum_v pi_old(v)^2 (optimal token baselines)
    response_attention: Optional[torch.Tensor] = None  # [batch, resp_len] float, 1 on every response token ATTENDED
    #   (sampled ones and the tool / user messages an agent loop put between them); None: response_mask
    token_versions: Optional[torch.Tensor] = None  # [batch, resp_len] long, policy version each sampled token came from
    #   (agent loops; -1 off sampled tokens); None: `versions` for every token
    teacher_logprobs: Optional[torch.Tensor] = None  # [batch, resp_len] the distillation teacher's log-prob of each
    #   sampled token, or [batch, resp_len, k] its top-k log-probs (distillation_loss.loss_mode=forward_kl_topk)
    teacher_ids: Optional[torch.Tensor] = None    # [batch, resp_len, k] long, the teacher's top-k tokens; None: not top-k
    sampled_from: Optional[torch.Tensor] = None   # [batch, resp_len, k] long: the ids the sampler's top-k / top-p kept
    #   at each sampled token, -1 padded (a position of all -1: the whole vocabulary). Old, new and reference log-probs
    #   are taken over this set, the distribution the token was drawn from; None: the whole vocabulary everywhere
    grammar_masks: Optional[list[dict]] = None  # per row, the response tokens sampled under a decoding grammar (a forced
    #   tool call, a JSON answer through the gateway): {"cols": [m] long, "bits": [m, ceil(vocab / 32)] int32, bit i of
    #   word w set where id 32w + i was allowed}, {} for a row without; None: no row. Log-probs there are taken over
    #   the allowed ids (plait/workers/grammar.py, logprobs.py Support)
    multi_modal_inputs: Optional[list[dict]] = None  # per row, a VL model's processor outputs: {"pixel_values":
    #   [patches, 3 * temporal_patch * patch^2], "image_grid_thw": [images, 3]}, {} for a text row; None: no media.
    #   Every forward over the row (old log-prob, ref, update) gives them to the model (plait/models_vl.vl_inputs)
    agent_infos: Optional[list[dict]] = None  # per row, from an agent loop: num_turns, reward_score, seconds in
    #   generate_sequences / tool_calls (plait/agents/worker.py); None: no agent loop ran
    scores: list[float] = field(default_factory=list)
    sample_ids: Optional[list[str]] = None  # per row, its id in samples.jsonl (plait/profiler/samples.py); None: untracked

    def __len__(self) -> int:
        return self.responses.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)  # [batch, prompt_len + resp_len]

    @property
    def attended(self) -> torch.Tensor:
        """Response tokens the model attends to [batch, resp_len]; response_mask is the subset trained on."""
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.attended.to(self.prompt_mask.dtype)], dim=1)  # [batch, prompt_len + resp_len]

    @property
    def token_version_map(self) -> torch.Tensor:
        """[batch, resp_len] long: the policy version of each sampled token, -1 elsewhere (token_versions or its default)."""
        return self.token_versions if self.token_versions is not None else _default(self, "token_versions")

    def select(self, idx: torch.Tensor | list[int] | slice) -> "RolloutBatch":
        """Rows `idx` of every field."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        index = torch.as_tensor(rows, dtype=torch.long)
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value.index_select(0, index)
            elif isinstance(value, list) and len(value) == len(self):
                out[f.name] = [value[i] for i in rows]
            else:
                out[f.name] = value
        return RolloutBatch(**out)

    def split(self, n: int) -> list["RolloutBatch"]:
        """`n` contiguous, near-equal chunks (data-parallel dispatch)."""
        bounds = torch.linspace(0, len(self), n + 1).round().long().tolist()
        return [self.select(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def concat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        """Join batches row-wise, padding prompts on the left and responses on the right."""
        if len(parts) == 1:
            return parts[0]
        pad_p = max(p.prompts.shape[1] for p in parts)
        pad_r = max(p.responses.shape[1] for p in parts)
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            values = [getattr(p, f.name) for p in parts]
            if all(v is None for v in values):
                out[f.name] = None
            elif f.name in _DEFAULTED and any(v is None for v in values):  # some parts single-turn: fill in the default
                values = [_default(p, f.name) if v is None else v for p, v in zip(parts, values)]
                out[f.name] = _cat(values, f.name, pad_p, pad_r)
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = _cat(values, f.name, pad_p, pad_r)
            else:
                out[f.name] = [x for p, v in zip(parts, values) for x in (v if v is not None else [{}] * len(p))]
        return RolloutBatch(**out)

    def replace(self, **changes) -> "RolloutBatch":
        return dataclasses.replace(self, **changes)


_DEFAULTED = ("response_attention", "token_versions", "sampled_from")  # None means a default (see the field comments)


def _default(batch: RolloutBatch, name: str) -> torch.Tensor:
    """What a None `response_attention` / `token_versions` / `sampled_from` stands for, as a tensor [batch, resp_len(, 1)]."""
    if name == "response_attention":
        return batch.response_mask
    if name == "sampled_from":
        return torch.full((*batch.response_mask.shape, 1), -1, dtype=torch.long)
    sampled = batch.response_mask.bool()
    return torch.where(sampled, batch.versions[:, None].expand_as(sampled), torch.full_like(sampled, -1, dtype=torch.long))


def _cat(values: list[torch.Tensor], name: str, prompt_len: int, resp_len: int) -> torch.Tensor:
    width = max(v.shape[-1] for v in values) if name == "sampled_from" else None  # kept sets differ in size
    return torch.cat([_pad_to(v, name, prompt_len, resp_len, width) for v in values], dim=0)


def _pad_to(t: torch.Tensor, name: str, prompt_len: int, resp_len: int, width: int | None = None) -> torch.Tensor:
    if name in ("prompts", "prompt_mask"):  # left-padded
        return torch.nn.functional.pad(t, (prompt_len - t.shape[1], 0), value=0)
    if name == "sampled_from":               # [batch, resp_len, k]: -1 is "no id" (0 is a token)
        return torch.nn.functional.pad(t, (0, width - t.shape[2], 0, resp_len - t.shape[1]), value=-1)
    if t.dim() in (2, 3):                    # response-aligned ([batch, resp_len(, k)]), right-padded
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, resp_len - t.shape[1]), value=0)
    return t
