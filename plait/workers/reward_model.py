"""The reward-model role: a Hugging Face sequence-classification model (one label) scores each
prompt + response, as verl's `reward_model.enable=true` does.

The rollout's token ids are decoded with the policy's tokenizer (`reward_model.model.input_tokenizer`
when set, as in verl) and encoded again with the reward model's own, from its directory, since the
two rarely share a vocabulary. When the row's chat messages travel in `extra_info["raw_prompt"]`
(`data.return_raw_chat`) and the reward model's tokenizer has a chat template, the conversation
with the response as the assistant's turn is rendered with that template; otherwise the prompt
text and the response text are joined. The score is the model's logit at the last token.
Data-parallel like the actor (plait/workers/parallel.py): each rank scores its share of the rows,
sharded like the actor (`actor_rollout_ref.actor.strategy`, its `fsdp_config`).
Left out: dynamic batch sizes and sequence packing (micro-batches are fixed-size).
"""

from __future__ import annotations

import torch

from plait.config import FsdpConfig
from plait.models import load_reward_model, load_tokenizer
from plait.types import RolloutBatch
from plait.workers.parallel import data_parallel, even_micro_batches, shard_model, use_fsdp


class RewardModel:
    def __init__(self, model_path: str, policy_tokenizer, profiler, micro_batch_size: int | None = None,
                 max_length: int | None = None, input_tokenizer: str | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, strategy: str = "fsdp",
                 fsdp_config: FsdpConfig | None = None):
        self.profiler, self.micro_batch_size, self.max_length = profiler, micro_batch_size, max_length
        self.input_tokenizer = load_tokenizer(input_tokenizer) if input_tokenizer else policy_tokenizer
        self.tokenizer = load_tokenizer(model_path)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # the score is read at the last token: keep the end
        self.model = load_reward_model(model_path, dtype=dtype, device=device)
        # The model finds each row's last token by its pad id: it must be the one this tokenizer pads with.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if use_fsdp(strategy, device):
            shard_model(self.model, self.model._no_split_modules or [], fsdp_config or FsdpConfig(), device)

    def compute_rm_score(self, batch: RolloutBatch) -> list[float]:
        """One score per response."""
        with self.profiler.annotate("reward_model"):
            [scores] = data_parallel(batch, lambda share: [self._scores(share)], "RewardModel.compute_rm_score")
            return scores.tolist()

    def _scores(self, batch: RolloutBatch) -> torch.Tensor:
        texts = self.texts(batch)
        size = self.micro_batch_size or len(texts)
        chunks = [list(range(start, min(start + size, len(texts)))) for start in range(0, len(texts), size)]
        scores = torch.zeros(len(texts))                                       # [rows]
        for rows, _ in even_micro_batches(chunks, self.model):
            scores[rows] = torch.tensor(self._score([texts[i] for i in rows]))
        return scores

    def texts(self, batch: RolloutBatch) -> list[str]:
        """Each prompt + response as text for the reward model's tokenizer."""
        decode = lambda ids: self.input_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        out = []
        for i in range(len(batch)):
            response = decode(batch.responses[i][batch.attended[i].bool()].tolist())
            raw = (batch.extra_infos[i] or {}).get("raw_prompt")
            if isinstance(raw, list) and self.tokenizer.chat_template is not None:
                chat = [*raw, {"role": "assistant", "content": response}]
                out.append(self.tokenizer.apply_chat_template(chat, tokenize=False))
            else:
                out.append(decode(batch.prompts[i][batch.prompt_mask[i].bool()].tolist()) + response)
        return out

    @torch.no_grad()
    def _score(self, texts: list[str]) -> list[float]:
        device = next(self.model.parameters()).device
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                             truncation=self.max_length is not None, max_length=self.max_length).to(device)
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits  # [micro, 1]
        return logits[:, 0].float().tolist()
