"""plait's built-in generation engine: a batched, KV-cached decode loop with per-token log-probs.

`TransformersEngine.generate` left-pads the prompts into one batch, prefills once, then decodes one
token per step for all rows until every row has hit an EOS id or `max_new_tokens`, or until
`abort()` is called from another thread. Each sampled token comes with its log-prob under the
distribution it was drawn from: softmax(logits / temperature), renormalised over the tokens top-k /
top-p kept, and with that kept set (`Generation.kept`), so the trainer takes its log-probs over the
same set (plait/workers/logprobs.py only_supported) and the ratio compares the policy that sampled. A
`SamplingParams.grammar` (the gateway's forced tool calls and JSON output, workers/grammar.py) masks, per row,
the tokens its grammar does not allow before each draw.

Where the time goes: with the small models plait trains on CPU, a decode step costs more in
per-op Python and dispatch than in arithmetic, and HF's forward adds mask building, rotary
recompute, cache objects and output classes to every step. So for Llama-layout decoders (llama,
qwen2 without sliding window) `_LlamaStepper` prefills through the HF forward once, then decodes
layer by layer on the model's own parameters with preallocated KV buffers, a rotary table and a
key mask built once per call; every other causal LM decodes through its HF forward with a
`DynamicCache` (`_HFStepper`). Sampling is vectorised: an inverse-CDF draw, no per-row Python.
bench/bench_decode.py has the numbers against HF generate.

Finished rows leave the batch once they are half of it; no new prompts join (no continuous
batching). Left out: beam search, repetition penalties, stop strings, min_new_tokens, speculative
decoding, CUDA graphs. plait/workers/engine.py is the seam (the `hf` row); vllm_engine.py is vLLM behind it.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from plait.configtree import check
from plait.models import load_causal_lm
from plait.models_vl import is_vl, mask_logits, never_sampled, sequence_logprobs, vl_inputs
from plait.workers.grammar import Grammar


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # log-probs are always under softmax(logits / temperature), greedy included
    top_p: float = 1.0        # nucleus: keep the fewest tokens whose probability reaches top_p
    top_k: int = -1           # -1 or 0: off
    do_sample: bool = True    # False: greedy (argmax of the logits)
    grammar: Grammar | None = None  # a decoding constraint (workers/grammar.py): every row writes what it allows

    def __post_init__(self):
        check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        check(self.temperature > 0, "temperature", self.temperature, "> 0 (use do_sample=False for greedy)")
        check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        check(self.top_k >= -1, "top_k", self.top_k, "-1 or 0 (off) or a positive integer")


@dataclass
class Generation:
    responses: torch.Tensor      # [batch, max_len] long, right-padded with pad_token_id
    response_mask: torch.Tensor  # [batch, max_len] float, 1 for generated tokens (EOS included)
    logprobs: torch.Tensor       # [batch, max_len] float32, 0 at padding
    stop_reasons: list[str]      # per row: "eos" | "length" | "aborted"
    prefilled: float = 0.0       # wall time the prefill ended, where the caller asked (agent-loop rounds); 0: unknown
    kept: torch.Tensor | None = None  # [batch, max_len, k] long: the ids top-k / top-p kept at each token, -1 padded;
    #   None: no filter (the whole vocabulary)


def build(args) -> TransformersEngine:
    """The `hf` row's factory (args: workers/engine.py's EngineArgs): the model in this process, frozen."""
    model = load_causal_lm(args.model_path, dtype=args.dtype, device=args.device).eval().requires_grad_(False)
    return TransformersEngine(model, pad_token_id=args.pad_token_id, eos_token_ids=args.eos_token_ids)


class TransformersEngine:
    """plait's Engine (workers/engine.py) over an in-process transformers causal LM, on the model's device."""
    continuous = False  # agent loops batch its requests in rounds of `generate`

    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_ids: list[int]):
        self.model, self.pad_token_id, self.eos_token_ids = model, pad_token_id, list(eos_token_ids)
        self._abort = threading.Event()

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, on_forward=None,
                 multi_modal: list[dict] | None = None) -> Generation:
        """Sample a response per prompt. `generator` makes it reproducible (CPU or model device).
        `on_forward(i)` is called before the forward that yields response token i (0: the prefill): the
        profiler's token gate (RoleProfiler.decode_steps). `multi_modal`: per prompt, a VL model's processor
        outputs ({"pixel_values", "image_grid_thw"}, {} for a text prompt; Rollout makes them)."""
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("generate needs at least one prompt and no empty prompts")
        self._abort.clear()  # an abort() while idle must not cut the next call short
        device, n, pad = self.model.device, params.max_new_tokens, self.pad_token_id
        with torch.inference_mode():
            ids, real = left_padded(prompts, pad, device)                    # [batch, width] x2
            stepper = self._stepper(real, ids.shape[1] + n, multi_modal)
            eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
            prompt_len = real.sum(-1)                                        # [active]
            tokens = torch.full((len(prompts), n), pad, device=device)       # [batch, n]
            logprobs = torch.zeros(len(prompts), n, device=device)           # [batch, n]
            rows = torch.arange(len(prompts), device=device)                 # [active] output row of each active row
            done = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # [active]
            kept_steps = []                                                  # (rows, step, kept [active, k]) per step
            if on_forward is not None:
                on_forward(0)
            logits = stepper.prefill(ids, (real.cumsum(-1) - 1).clamp(min=0))  # [active, vocab]
            banned = never_sampled(self.model.config)                          # a VL model's image / video pads
            constrained = None if params.grammar is None else _Constrained(params.grammar, len(prompts))
            for step in range(n):
                scores = mask_logits(logits.float(), banned)                    # [active, vocab]
                if constrained is not None:  # the draw and its log-prob are both over what the grammar allows
                    scores = constrained.mask(scores, rows, done)
                tok, logp, kept = sample_tokens(scores, params, generator)  # [active] x2
                if constrained is not None:
                    constrained.consume(tok)
                tokens[rows, step] = tok.masked_fill(done, pad)
                logprobs[rows, step] = logp.masked_fill(done, 0.0)
                if kept is not None:
                    kept_steps.append((rows, step, kept.masked_fill(done[:, None], -1)))
                done |= torch.isin(tok, eos)
                finished = int(done.sum())  # the one host sync per step
                if step + 1 == n or finished == len(done) or self._abort.is_set():
                    break
                if finished >= len(done) / 2:
                    # Drop finished rows once they are half the batch: RL response lengths are
                    # long-tailed, and the rest of the call then costs half (bench_decode, EOS on).
                    keep = (~done).nonzero()[:, 0]
                    stepper.select(keep)
                    rows, done, tok, prompt_len = rows[keep], done[keep], tok[keep], prompt_len[keep]
                if on_forward is not None:
                    on_forward(step + 1)
                logits = stepper.decode(tok, prompt_len + step)
            tokens, logprobs = tokens[:, :step + 1], logprobs[:, :step + 1]  # [batch, steps]
            is_eos = torch.isin(tokens, eos)
            mask = (is_eos.cumsum(1) - is_eos.long()) == 0                  # up to and including the first EOS
            stop_reasons = ["eos" if e else "length" if step + 1 == n else "aborted" for e in is_eos.any(1).tolist()]
            kept = _stack_kept(kept_steps, tokens.shape) if kept_steps else None
        # clone() outside inference mode: inference tensors cannot be saved for backward, and
        # the trainer feeds these responses to forwards that need grad.
        return Generation(responses=tokens.clone(), response_mask=mask.float(), logprobs=logprobs.clone(),
                          stop_reasons=stop_reasons, kept=None if kept is None else kept.clone())

    def _stepper(self, real: torch.Tensor, length: int, multi_modal: list[dict] | None):
        """The decoder of one generate: plait's own for Llama-layout models, the VL model's, else transformers'."""
        if is_vl(self.model.config):
            return _VLStepper(self.model, real, length, multi_modal or [{}] * len(real))
        return (_LlamaStepper if _is_llama_layout(self.model.config) else _HFStepper)(self.model, real, length)

    def load_weights(self, state_dict: dict[str, torch.Tensor], share: bool = False) -> None:
        """Copy tensors into the model in place; names as in model.state_dict(). Tied weights share
        storage, so either name updates both. `share`: a parameter whose new value already has its
        dtype and device takes that tensor as its storage instead (zero copies; the model then reads
        the caller's tensor, so the caller must not change it during a generate)."""
        own = self.model.state_dict()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, value in state_dict.items():
                if name not in own:
                    raise KeyError(f"load_weights: {name!r} is not in the model's state_dict")
                if value.shape != own[name].shape:
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(value.shape)}, "
                                     f"the model's has {tuple(own[name].shape)}")
                if share and name in params and (value.dtype, value.device) == (own[name].dtype, own[name].device):
                    params[name].data = value
                else:
                    own[name].copy_(value)

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The weight-sync check's probe under the weights this engine holds (plait/workers/weight_sync.py)."""
        with torch.inference_mode():
            return sequence_logprobs(self.model, ids)

    def abort(self) -> None:
        """Thread-safe: a running generate returns at its next decode step; unfinished rows say "aborted"."""
        self._abort.set()

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pick one token per row; return (tokens [batch], their log-probs [batch], the kept set [batch, k] or None).

    Top-k, then top-p over the renormalised top-k, as HF does. A token's log-prob is under the distribution
    it was drawn from: softmax(logits / T) renormalised over the kept ids (-1 pads a row's set; None: no
    filter, the whole vocabulary). The draw is inverse-CDF with one uniform per row: several times cheaper
    on CPU than torch.multinomial, which draws batch x vocab exponentials.
    """
    scaled = logits.float() / params.temperature                              # [batch, vocab]
    if not params.do_sample:
        tok = logits.argmax(-1, keepdim=True)                                 # [batch, 1]
        return tok[:, 0], scaled.log_softmax(-1).gather(-1, tok)[:, 0], None
    top_k = params.top_k if 0 < params.top_k < logits.shape[-1] else 0
    if not (top_k or params.top_p < 1):
        logp = scaled.log_softmax(-1)                                         # [batch, vocab]
        tok = _draw(logp.exp(), generator)
        return tok[:, 0], logp.gather(-1, tok)[:, 0], None
    vals, order = scaled.topk(top_k) if top_k else scaled.sort(-1, descending=True)  # [batch, k]
    dropped = None
    if params.top_p < 1:  # drop a token once the mass before it has reached top_p
        probs = vals.softmax(-1)
        dropped = probs.cumsum(-1) - probs >= params.top_p                    # [batch, k]
        width = int((~dropped).sum(-1).max())                                 # the kept ids lead each row
        vals, order, dropped = vals[:, :width], order[:, :width], dropped[:, :width]
        vals = vals.masked_fill(dropped, float("-inf"))
    logp = vals.log_softmax(-1)                                               # [batch, k] over the kept set
    pick = _draw(logp.exp(), generator)                                       # [batch, 1]
    kept = order if dropped is None else order.masked_fill(dropped, -1)
    return order.gather(-1, pick)[:, 0], logp.gather(-1, pick)[:, 0], kept


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of `probs` [batch, k] (zeros never drawn) -> [batch, 1]."""
    cdf = probs.cumsum(-1)                                                    # [batch, k]
    # u in (0, 1] and "first cdf >= u * total" never lands on a zero-probability token or past the end
    u = 1 - torch.rand(len(cdf), 1, generator=generator,
                       device=generator.device if generator is not None else cdf.device)
    return torch.searchsorted(cdf, u.to(cdf.device) * cdf[:, -1:])           # [batch, 1]


def left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, real) [batch, width]: the prompts left-padded to the longest, and 1 where a token is the prompt's."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    real = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, real


class _Constrained:
    """A grammar's matchers over one generate, one per output row: the allowed tokens before each draw (rows
    already done draw freely: their tokens are padding), then the drawn tokens consumed."""

    def __init__(self, grammar, rows: int):
        self.grammar, self.matchers, self.live = grammar, [grammar.matcher() for _ in range(rows)], []

    def mask(self, scores: torch.Tensor, rows: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        self.live = [None if d else self.matchers[r] for r, d in zip(rows.tolist(), done.tolist())]
        allowed = self.grammar.allowed(self.live, scores.shape[-1]).to(scores.device)
        return scores.masked_fill(~allowed, float("-inf"))

    def consume(self, tokens: torch.Tensor) -> None:
        for matcher, token in zip(self.live, tokens.tolist()):
            if matcher is not None:
                matcher.consume_token(token)


def _stack_kept(steps: list, shape: torch.Size) -> torch.Tensor:
    """The per-step kept sets (output rows, step, [active, k]) as one [batch, steps, k] tensor, -1 padded."""
    width = max(kept.shape[-1] for _, _, kept in steps)
    out = torch.full((*shape, width), -1, dtype=torch.long, device=steps[0][2].device)  # [batch, n, k]
    for rows, step, kept in steps:
        out[rows, step, :kept.shape[-1]] = kept
    return out


def _is_llama_layout(config) -> bool:
    # These run through _LlamaStepper; Qwen2's sliding-window layers need another mask, so they
    # and every other architecture take the generic path.
    return config.model_type == "llama" or (config.model_type == "qwen2" and config.sliding_window is None)


class _HFStepper:
    """Any causal LM, through its own forward and a DynamicCache."""

    def __init__(self, model: PreTrainedModel, real: torch.Tensor, total_len: int):
        self.model, self.seen = model, 0
        self.cache = DynamicCache(config=model.config)
        self.mask = F.pad(real, (0, total_len - real.shape[1]), value=1)   # [batch, total_len] 1 = attend

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the prompts ([batch, width], left-padded); return the next-token logits [batch, vocab]."""
        self.seen = ids.shape[1]
        return prefill_logits(self.model, input_ids=ids, attention_mask=self.mask[:, :self.seen], position_ids=positions,
                              **cache_kwarg(self.model, self.cache))

    def decode(self, tok: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([active]); return the next-token logits [active, vocab]."""
        self.seen += 1
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask[:, :self.seen],
                         position_ids=positions[:, None], **cache_kwarg(self.model, self.cache), use_cache=True)
        return out.logits[:, -1]

    def select(self, keep: torch.Tensor) -> None:
        """Keep only these batch rows."""
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]


class _VLStepper(_HFStepper):
    """Qwen2-VL / Qwen2.5-VL: the prefill takes the images and the 3-axis rope positions
    (models_vl.vl_inputs, as the training passes compute them); a decoded token continues the text, at
    the row's largest prompt position + 1 + its index on all three axes (Qwen's rope delta)."""

    def __init__(self, model: PreTrainedModel, real: torch.Tensor, total_len: int, rows: list[dict]):
        super().__init__(model, real, total_len)
        self.rows = rows
        self.delta = torch.zeros(real.shape[0], dtype=torch.long, device=real.device)  # [active] rope - text position

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.seen = ids.shape[1]
        real = self.mask[:, :self.seen]
        inputs = vl_inputs(self.model.config, self.rows, ids, real)
        rope = inputs["position_ids"].masked_fill(~real.bool(), 0)            # [3, batch, width]
        self.delta = rope.amax(dim=(0, 2)) + 1 - real.sum(-1)               # [batch]
        return prefill_logits(self.model, input_ids=ids, attention_mask=real, **inputs, **cache_kwarg(self.model, self.cache))

    def decode(self, tok: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().decode(tok, positions + self.delta)                 # 2-D positions: the same on each axis

    def select(self, keep: torch.Tensor) -> None:
        super().select(keep)
        self.delta = self.delta[keep]


def prefill_logits(model: PreTrainedModel, **inputs) -> torch.Tensor:
    """The next-token logits [batch, vocab] of a prefill that fills the cache: the LM head on the last position's
    hidden state, contiguous. (transformers' logits_to_keep=1 hands the head a strided [batch, 1, hidden] view,
    which torch's CPU linear runs as a batched matmul over a copy of the head per row: SmolLM2, 16 rows, bf16
    3.2 s instead of 9 ms.)"""
    keep = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    hidden = model(**inputs, use_cache=True, logits_to_keep=keep, output_hidden_states=-1).hidden_states[-1]
    return model.get_output_embeddings()(hidden[:, -1].contiguous())   # [batch, vocab]


def cache_kwarg(model: PreTrainedModel, cache: DynamicCache) -> dict:
    """transformers renamed forward's `past_key_values` to `cache` (5.2x); pass it under the name this model takes."""
    return {_cache_name(type(model)): cache}


@functools.cache
def _cache_name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


class _LlamaStepper:
    """Llama-layout decoders: the prompt goes through the HF forward once, then each decode step runs
    layer by layer on [batch, hidden] tensors, using the model's own parameter tensors (the ones
    load_weights updates; q, k and v stacked into one per call) and its own MLP module (any activation)."""

    def __init__(self, model: PreTrainedModel, real: torch.Tensor, total_len: int):
        self.model, self.real, self.seen = model, real, 0
        inner, cfg = model.model, model.config
        # Module attribute lookups cost as much as the small ops here, so take the tensors once.
        self.layers = [_LayerRefs.of(layer) for layer in inner.layers]
        self.embed, self.norm, self.head = inner.embed_tokens.weight, _norm_refs(inner.norm), model.lm_head.weight
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        dtype, device = inner.embed_tokens.weight.dtype, real.device
        shape = (real.shape[0], cfg.num_key_value_heads, total_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in inner.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in inner.layers]
        cos, sin = inner.rotary_emb(self.keys[0], torch.arange(total_len, device=device)[None])
        half = self.head_dim // 2
        # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi], exactly: one op instead of four
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)  # [total_len, head_dim]
        real_keys = F.pad(real, (0, total_len - real.shape[1]), value=1).bool()
        # finfo.min, not -inf, as HF does: no softmax row may be all -inf
        self.key_bias = torch.zeros(real_keys.shape, dtype=dtype, device=device).masked_fill_(
            ~real_keys, torch.finfo(dtype).min)                               # [batch, total_len]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cache, self.seen = DynamicCache(config=self.model.config), ids.shape[1]
        logits = prefill_logits(self.model, input_ids=ids, attention_mask=self.real, position_ids=positions,
                                **cache_kwarg(self.model, cache))
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            keys[:, :, :self.seen], values[:, :, :self.seen] = layer.keys, layer.values
        return logits                                                        # [batch, vocab]

    def decode(self, tok: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, d, group = tok.shape[0], self.head_dim, self.group
        slot, self.seen = self.seen, self.seen + 1
        mask = self.key_bias[:, None, None, :self.seen]                      # [batch, 1, 1, seen]
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # [batch, 1, 1, head_dim]
        h = F.embedding(tok, self.embed)                                     # [batch, hidden]
        hidden = h.shape[-1:]
        for p, keys, values in zip(self.layers, self.keys, self.values):
            x = F.rms_norm(h, hidden, *p.norm1)
            # one query per row: group the query heads under their kv head instead of repeating the cache
            q, k, v = F.linear(x, *p.qkv).split(p.qkv_sizes, -1)
            q = q.view(batch, -1, group, d)                                  # [batch, kv_heads, group, head_dim]
            k = k.view(batch, -1, 1, d)                                      # [batch, kv_heads, 1, head_dim]
            keys.narrow(2, slot, 1).copy_(torch.addcmul(k * cos, k.roll(d // 2, -1), sin))
            values.narrow(2, slot, 1).copy_(v.view(batch, -1, 1, d))
            q = torch.addcmul(q * cos, q.roll(d // 2, -1), sin)
            o = F.scaled_dot_product_attention(q, keys.narrow(2, 0, self.seen), values.narrow(2, 0, self.seen),
                                               attn_mask=mask, scale=p.scale)  # [batch, kv_heads, group, head_dim]
            h = h + F.linear(o.reshape(batch, -1), *p.o)
            h = h + p.mlp(F.rms_norm(h, hidden, *p.norm2))
        return F.linear(F.rms_norm(h, hidden, *self.norm), self.head)        # [batch, vocab]

    def select(self, keep: torch.Tensor) -> None:
        """Keep only these batch rows."""
        self.keys, self.values = [k[keep] for k in self.keys], [v[keep] for v in self.values]
        self.key_bias = self.key_bias[keep]


class _LayerRefs(NamedTuple):
    """One Llama-layout decoder layer's parameters, as F.linear / F.rms_norm arguments."""
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias) of q, k, v stacked: one matmul a step
    qkv_sizes: tuple[int, int, int]
    o: tuple[torch.Tensor, torch.Tensor | None]
    norm1: tuple[torch.Tensor, float]            # (weight, eps)
    norm2: tuple[torch.Tensor, float]
    mlp: torch.nn.Module
    scale: float

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerRefs:
        a = layer.self_attn
        projections = (a.q_proj, a.k_proj, a.v_proj)
        # Stacked once per generate call (weights never change during one: Rollout holds its lock).
        weight = torch.cat([lin.weight for lin in projections])
        bias = None if a.q_proj.bias is None else torch.cat([lin.bias for lin in projections])
        return cls((weight, bias), tuple(lin.weight.shape[0] for lin in projections), (a.o_proj.weight, a.o_proj.bias),
                   _norm_refs(layer.input_layernorm), _norm_refs(layer.post_attention_layernorm), layer.mlp, a.scaling)


def _norm_refs(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon
