"""The teacher role of on-policy distillation: frozen causal LMs scoring the student's sampled tokens.

One worker holds every teacher of `distillation.teacher_models` and routes each row to the teacher whose
key is the row's routing value (`route`); with one teacher every row goes to it. A teacher scores a row
with one forward pass over the student's prompt and response at temperature 1 (as verl's teachers do,
whatever the student samples at) and returns, per response token, the log-prob of the token the student
sampled ([batch, resp_len]), or for the top-k loss its own k most likely tokens and their log-probs
([batch, resp_len, k] each). Rows are split over the role's data-parallel ranks as the ref's are; forward
passes hold at most `inference.max_num_batched_tokens` tokens (a longer row gets one of its own).

The teachers read the student's token ids, so they must share its tokenizer (checked at start by the
builder). Left out: serving a teacher from a rollout engine (verl's vLLM/SGLang servers), tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.models import load_causal_lm
from plait.types import RolloutBatch
from plait.workers.logprobs import check_lm_head, response_logprobs, response_topk
from plait.workers.packing import MicroBatching, checked_remove_padding
from plait.workers.parallel import data_parallel
from plait.workers.precision import compute_autocast


@dataclass
class TeacherSpec:
    """One teacher: its folder, the config key naming it (for errors), its forwards' compute dtype (the
    weights stay float32, as the ref's) and the token budget of one forward."""
    model_path: str
    config_key: str
    dtype: torch.dtype = torch.float32
    max_tokens: int | None = None


@dataclass
class Route:
    """Which row goes to which teacher: the row's data_source when `column` is the data's reward_fn_key column
    (None), else its extra_info[column]; a single teacher takes every row."""
    column: str | None
    single: str | None  # the one teacher's key, or None with several

    def keys(self, batch: RolloutBatch) -> list:
        if self.single is not None:
            return [self.single] * len(batch)
        if self.column is None:
            return list(batch.data_sources)
        return [route_value(info.get(self.column)) for info in batch.extra_infos]


def route_value(value) -> str | None:
    """A row's routing value as the teachers' keys are written (config keys are strings: 1 and "1" agree)."""
    return None if value is None else str(value)


class Teacher:
    def __init__(self, teachers: dict[str, TeacherSpec], topk: int, route: Route, profiler, device: str = "cpu",
                 remove_padding: bool = False):
        """`teachers`: routing key -> teacher; `topk` 0: the sampled token's log-prob, else the top-k."""
        self.topk, self.route, self.profiler, self.device, self.specs = topk, route, profiler, device, teachers
        self.models, self.layouts = {}, {}
        for key, spec in teachers.items():
            model = load_causal_lm(spec.model_path, dtype=torch.float32, device=device, key=spec.config_key).eval()
            model.requires_grad_(False)
            check_lm_head(model, spec.config_key)
            self.models[key] = model
            self.layouts[key] = MicroBatching(None, spec.max_tokens, checked_remove_padding(model, remove_padding))

    def compute_teacher_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, ids) per response token: the teacher's log-prob of the sampled token [batch, resp_len]
        and None; with `topk`, its top-k log-probs and ids [batch, resp_len, k]."""
        with self.profiler.annotate("teacher"), torch.no_grad():
            out = data_parallel(batch, self._score, "Teacher.compute_teacher_log_prob")
        return (out[0], out[1].long()) if self.topk else (out[0], None)

    def _score(self, batch: RolloutBatch) -> tuple[torch.Tensor, ...]:
        """This rank's rows, each through its teacher, micro-batch by micro-batch."""
        shape = (*batch.responses.shape, self.topk) if self.topk else batch.responses.shape
        logp, ids = torch.zeros(shape), torch.zeros(shape)                     # ids: float for the gather
        keys = self.route.keys(batch)
        for key, model in self.models.items():
            mine = [i for i, k in enumerate(keys) if k == key]
            if not mine:
                continue
            part = batch.select(mine)
            layout = self.layouts[key]
            device = next(model.parameters()).device
            for rows in layout.split(part):
                micro, at = part.select(rows), torch.tensor([mine[r] for r in rows])
                args = (model, micro.input_ids.to(device), micro.attention_mask.to(device), micro.responses.shape[1])
                with compute_autocast(self.device, self.specs[key].dtype, False):
                    if self.topk:
                        top_logp, top_ids = response_topk(*args, self.topk, layout.remove_padding, micro.multi_modal_inputs)
                        logp[at], ids[at] = top_logp.float().cpu(), top_ids.float().cpu()
                    else:
                        logp[at] = response_logprobs(*args, 1.0, False, layout.remove_padding,
                                                     micro.multi_modal_inputs)[0].float().cpu()
        return (logp, ids) if self.topk else (logp,)
