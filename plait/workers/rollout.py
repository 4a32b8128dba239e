"""The rollout role: sample n responses per prompt with token log-probs, and take new weights.

Generation itself is the engine's job (plait/workers/rollout_engine.py: a lean KV-cached decode
loop over a transformers model; a vLLM or SGLang engine plugs in behind the same interface). This
worker turns prompts into a `RolloutBatch`, keeps the policy version its weights belong to, and
loads weights pushed by the trainer.
"""

from __future__ import annotations

import torch

from plait.config import SamplingConfig
from plait.models import eos_token_ids, load_causal_lm
from plait.types import PromptBatch, RolloutBatch
from plait.workers.rollout_engine import SamplingParams, TransformersEngine


class Rollout:
    def __init__(self, model_path: str, max_response_length: int, tokenizer, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.max_response_length, self.pad_token_id, self.profiler = max_response_length, tokenizer.pad_token_id, profiler
        self.model = load_causal_lm(model_path, dtype=dtype, device=device).eval()
        self.model.requires_grad_(False)
        self.engine = TransformersEngine(self.model, pad_token_id=self.pad_token_id,
                                         eos_token_ids=eos_token_ids(tokenizer, self.model))
        self.version = 0

    def generate(self, prompts: PromptBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        with self.profiler.annotate("gen"):
            return self._generate(prompts, sampling, seed)

    def _generate(self, prompts: PromptBatch, sampling: SamplingConfig, seed: int) -> RolloutBatch:
        n = sampling.n
        ids = [p for p in prompts.prompt_ids for _ in range(n)]   # each prompt n times, adjacent
        greedy = not sampling.do_sample or sampling.temperature == 0
        params = SamplingParams(max_new_tokens=self.max_response_length,
                                temperature=1.0 if sampling.temperature == 0 else sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, do_sample=not greedy)
        out = self.engine.generate(ids, params, generator=torch.Generator().manual_seed(seed))
        width = max(len(p) for p in ids)
        prompt_t = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, p in enumerate(ids):
            prompt_t[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, width - len(p):] = 1
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        return RolloutBatch(
            prompts=prompt_t, prompt_mask=prompt_mask,
            responses=out.responses.cpu(), response_mask=out.response_mask.float().cpu(),
            rollout_logprobs=out.logprobs.float().cpu(),
            group_ids=torch.tensor(rep(prompts.indices), dtype=torch.long),
            versions=torch.full((len(ids),), self.version, dtype=torch.long),
            data_sources=rep(prompts.data_sources), ground_truths=rep(prompts.ground_truths),
            extra_infos=rep(prompts.extra_infos), stop_reasons=list(out.stop_reasons))

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self.profiler.annotate("update_weights"):
            self.engine.load_weights(state_dict)
            self.version = version

    def abort(self) -> None:
        self.engine.abort()
