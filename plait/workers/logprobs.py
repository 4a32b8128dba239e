"""Log-probs and entropy of response tokens, with the LM head applied only where a loss reads them.

A log-prob pass needs logits only at the positions whose next token is a real response token: with
long prompts a small share of the batch (SmolLM2 at 160 prompt + 32 response tokens: 1/6), and no
padding. `response_logprobs` runs the model with no logits kept (its own forward, so FSDP2's and
peft's hooks run as usual) and reads the last hidden state, gathers the hidden states at those
positions in the padded or the packed layout, and applies the LM head `chunk_tokens` tokens at a
time (`chunked_logprobs`). A chunk's [chunk, vocab] logits exist only while that chunk is worked
on, in the backward too: `_HeadLogpEntropy` recomputes each chunk there and writes the gradients of
log-softmax, entropy and the head out (a few passes over the logits instead of autograd's many; the
head's weight gradient summed in place), in the autocast dtype under mixed precision. An FSDP2-sharded
model computes the head inside its own forward at the same positions, unchunked (`_sharded_logprobs`).
Where the sampler drew from less than the vocabulary (top-k / top-p's kept ids, a decoding grammar's allowed
set: `Support`), every pass takes the softmax over that set, a chunk's mask built only while it is worked on.

Left out: chunking over the vocabulary. The chunk's token count shrinks as the vocabulary grows
(`LOGITS_BUDGET`), so its logits keep the same size for any vocabulary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from plait.configtree import ConfigError
from plait.models_vl import is_vl, mask_logits, never_sampled, vl_inputs
from plait.workers.grammar import unpack
from plait.workers.packing import pack
from plait.workers.parallel import is_sharded

LOGITS_BUDGET = 2 ** 23  # logits per chunk (32 MiB in float32): 170 tokens of SmolLM2's 49152-word vocabulary
GRAD_BUDGET = 2 ** 26    # bytes of logits' gradients per matmul with the head's weight in the backward (4 chunks in bf16)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp_len: int,
                      temperature: float, with_entropy: bool, remove_padding: bool = False,
                      multi_modal: list[dict] | None = None, kept: torch.Tensor | None = None,
                      grammar: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy [batch, resp_len] of the last `resp_len` tokens of each row (rows are
    [left-padded prompt | right-padded response]), of softmax(logits / temperature); 0 at padding.

    `remove_padding`: the rows' real tokens go through the model packed (plait/workers/packing.py).
    `multi_modal`: a VL model's per-row processor outputs (RolloutBatch.multi_modal_inputs; None: text rows).
    `kept`: the sampler's top-k / top-p set at each response token [batch, resp_len, k] (RolloutBatch.sampled_from):
    the softmax is taken over it alone, the distribution the token was drawn from; None: the whole vocabulary.
    `grammar`: per row, the allowed sets of the tokens sampled under a decoding grammar (RolloutBatch.grammar_masks):
    there the softmax is taken over the ids the grammar allowed as well."""
    return response_stats(model, input_ids, attention_mask, resp_len, temperature, with_entropy, False,
                          remove_padding, multi_modal, kept, grammar)[:2]


def response_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp_len: int,
                   temperature: float, with_entropy: bool, with_sum_pi_squared: bool, remove_padding: bool = False,
                   multi_modal: list[dict] | None = None, kept: torch.Tensor | None = None,
                   grammar: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`response_logprobs`, plus with `with_sum_pi_squared` the sum over the vocabulary of the squared
    probabilities [batch, resp_len] at each response token (verl's sum_pi_squared: optimal-token-baseline
    estimators), from the same chunked LM head; no gradient flows through it."""
    return _stats(model, input_ids, attention_mask, resp_len, temperature, with_entropy, with_sum_pi_squared,
                  remove_padding, multi_modal, kept=kept, grammar=grammar)[:3]


def response_topk_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp_len: int,
                        temperature: float, with_entropy: bool, ids: torch.Tensor, remove_padding: bool = False,
                        multi_modal: list[dict] | None = None, kept: torch.Tensor | None = None,
                        grammar: list[dict] | None = None) -> tuple[torch.Tensor, ...]:
    """`response_logprobs` (log-probs and entropy [batch, resp_len]) and, from the same LM head pass, the
    log-probs at `ids` [batch, resp_len, k] (a teacher's top-k tokens; gradients flow as through the sampled
    token's) and this model's own top-k ids there [batch, resp_len, k] (no gradient): the student's side of
    a top-k distillation loss."""
    logp, ent, _, at_ids, top = _stats(model, input_ids, attention_mask, resp_len, temperature, with_entropy, False,
                                       remove_padding, multi_modal, ids=ids, kept=kept, grammar=grammar)
    return logp, ent, at_ids, top[1]


def response_topk(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp_len: int, k: int,
                  remove_padding: bool = False, multi_modal: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's k most likely tokens at each response position and their log-probs (temperature 1), both
    [batch, resp_len, k], most likely first: a teacher's side of a top-k distillation loss."""
    return _stats(model, input_ids, attention_mask, resp_len, 1.0, False, False, remove_padding, multi_modal, topk=k)[4]


def _stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp_len: int, temperature: float,
           with_entropy: bool, with_sum_pi_squared: bool, remove_padding: bool = False,
           multi_modal: list[dict] | None = None, ids: torch.Tensor | None = None, topk: int = 0,
           kept: torch.Tensor | None = None, grammar: list[dict] | None = None) -> tuple:
    """(logp, entropy, sum_pi_squared, log-probs at `ids`, (top-k log-probs, top-k ids)) of the response tokens,
    each padded to [batch, resp_len(, k)] (None where not asked); `ids` asks the top-k ids too (its k)."""
    resp_mask = attention_mask[:, -resp_len:]                                 # [batch, resp_len]
    rows, cols = resp_mask.nonzero(as_tuple=True)                             # [N] each: the real response tokens
    width = input_ids.shape[1]
    before = rows * width + width - resp_len + cols - 1                       # [N] flat index of the token before each
    packed = pack(input_ids, attention_mask) if remove_padding else None
    if remove_padding:
        inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids)
        where = torch.empty(input_ids.numel(), dtype=torch.long, device=input_ids.device)
        where[packed.source] = packed.target                                  # padded place -> packed place
        before = where[before]
    else:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0))
    if is_vl(model.config):  # images and the 3-axis rope positions, for text rows too (packed rows need them)
        media = multi_modal if multi_modal is not None else [{}] * input_ids.shape[0]
        inputs.update(vl_inputs(model.config, media, input_ids, attention_mask, packed))
    tokens = input_ids[:, -resp_len:][rows, cols]                             # [N]
    support = Support.at_tokens(rows, cols, resp_mask.shape, kept, grammar)
    if ids is not None:  # the sampled token first, then the k asked for: one gather, one gradient
        tokens, topk = torch.cat([tokens[:, None], ids.to(tokens.device)[rows, cols]], 1), ids.shape[-1]  # [N, 1 + k]
    if is_sharded(model):
        logp, ent, spsq, top_logp, top_ids = _sharded_logprobs(model, inputs, before, tokens, temperature, with_entropy,
                                                               with_sum_pi_squared, never_sampled(model.config), topk, support)
    else:
        hidden = last_hidden(model, **inputs).flatten(0, 1)[before]          # [N, hidden]
        logp, ent, spsq, top_logp, top_ids = _chunked(hidden, tokens, model.get_output_embeddings(), temperature,
                                                      with_entropy, with_sum_pi_squared, banned=never_sampled(model.config),
                                                      topk=topk, support=support)

    def padded(values):  # [N, ...] -> [batch, resp_len, ...], 0 at padding
        if values is None:
            return None
        return values.new_zeros(*resp_mask.shape, *values.shape[1:]).index_put((rows, cols), values)
    at_ids = None
    if ids is not None:
        logp, at_ids = logp[:, 0], logp[:, 1:]
    return (padded(logp), padded(ent), padded(spsq), padded(at_ids),
            (padded(top_logp), padded(top_ids)) if topk else None)


def _sharded_logprobs(model, inputs: dict, before: torch.Tensor, tokens: torch.Tensor, temperature: float,
                      with_entropy: bool, with_sum_pi_squared: bool = False,
                      banned: list[int] | None = None, topk: int = 0,
                      support: Support | None = None) -> tuple[torch.Tensor, ...]:
    """FSDP2: the LM head runs inside the root's forward, at the response positions only
    (`logits_to_keep` as a mask), so [N, vocab] logits exist at once. A head called per chunk after
    the root's forward (its own fully_shard group) gave wrong gradients of the head's group after a
    no-grad pass in torch 2.13 with 2 ranks."""
    keep = torch.zeros(inputs["input_ids"].numel(), dtype=torch.bool, device=before.device)
    keep[before] = True
    logits = model(**inputs, use_cache=False, logits_to_keep=keep.view_as(inputs["input_ids"])).logits
    order = torch.empty_like(before)
    order[before.argsort()] = torch.arange(len(before), device=before.device)  # mask order -> ours
    z = only_supported(mask_logits(logits[order].float() / temperature, banned), support)  # [N, vocab]
    logp, ent, top_logp, top_ids = _LogpEntropy.apply(z, tokens, with_entropy, topk)
    return logp, ent, _sum_squared_probs(z) if with_sum_pi_squared else None, top_logp, top_ids


def last_hidden(model, **inputs) -> torch.Tensor:
    """The final hidden state [rows, len, hidden] (after the last norm), the LM head's input.

    The model's own forward with an empty `logits_to_keep`: it computes [rows, 0, vocab] logits,
    and selecting hidden state -1 keeps no other layer's output alive."""
    keep = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    return model(**inputs, use_cache=False, logits_to_keep=keep, output_hidden_states=-1).hidden_states[-1]


def check_lm_head(model, key: str) -> None:
    """A ConfigError naming `key` when the model's logits are not its output embedding applied to the
    last hidden state (Gemma 2's soft-capping, Granite's scaling): the log-probs here would differ."""
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device).view(2, 4) % model.config.get_text_config().vocab_size
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_hidden_states=-1)
        logits = model.get_output_embeddings()(out.hidden_states[-1])
    if not torch.allclose(logits.float(), out.logits.float(), atol=1e-4, rtol=1e-4):
        raise ConfigError(key, model.config.name_or_path, f"{type(model).__name__}'s logits are not its LM head "
                          "applied to the last hidden state (soft-capped or scaled?); plait computes log-probs "
                          "from the LM head alone and does not support it yet")


def chunked_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head, temperature: float, with_entropy: bool,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(h) / T)[token] and the softmax's entropy [N] for hidden states [N, hidden].

    Logits are float32 whatever the model's dtype (a bf16 logsumexp is off by ~1e-2, which would
    show up in PPO ratios); under autocast (mixed precision) the head itself runs outside it, in its
    float32 weights. Under grad only `hidden` is kept and each chunk's logits are recomputed in the
    backward (`_HeadLogpEntropy`)."""
    return _chunked(hidden, tokens, head, temperature, with_entropy, False, chunk_tokens)[:2]


def _chunked(hidden: torch.Tensor, tokens: torch.Tensor, head, temperature: float, with_entropy: bool,
             with_sum_pi_squared: bool, chunk_tokens: int | None = None,
             banned: list[int] | None = None, topk: int = 0, support: Support | None = None) -> tuple[torch.Tensor, ...]:
    """`chunked_logprobs`, plus the sum of squared probabilities [N] (None unless asked; never under grad)
    and, with `topk`, the k most likely tokens' log-probs and ids [N, k] (no gradient); tokens `banned`
    (models_vl.never_sampled) get no probability. `tokens` [N] or [N, m] (several per position: log-probs
    [N, m] out); `support`: each position's softmax over the ids the sampler drew from (`only_supported`)."""
    chunk_tokens = chunk_tokens or max(1, LOGITS_BUDGET // head.out_features)
    grad = torch.is_grad_enabled()
    if grad and with_sum_pi_squared:
        raise ValueError("sum_pi_squared is computed in the no-grad log-prob pass only")
    if grad and type(head) is torch.nn.Linear:
        device = hidden.device.type  # mixed precision: the head's gradient is computed in the autocast dtype
        grad_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        logp, ent, top_logp, top_ids = _HeadLogpEntropy.apply(hidden, head.weight, head.bias, tokens, temperature,
                                                              with_entropy, chunk_tokens, banned, grad_dtype, topk, support)
        return logp, ent, None, top_logp, top_ids

    def logits(h, keep):
        with torch.autocast(h.device.type, enabled=False):
            return only_supported(mask_logits(head(h.to(head.weight.dtype)).float() / temperature, banned), keep)  # [chunk, vocab]

    def one(h, tok, keep):
        return _LogpEntropy.apply(logits(h, keep), tok, with_entropy, topk)
    parts = []
    for h, tok, keep in zip(hidden.split(chunk_tokens), tokens.split(chunk_tokens), _chunks(support, chunk_tokens)):
        if grad:  # a head that is not a plain Linear (a peft adapter on it): autograd through it, checkpointed
            parts.append((*checkpoint(one, h, tok, keep, use_reentrant=False), None))
        else:
            z = logits(h, keep)                                                # [chunk, vocab]
            parts.append((*_LogpEntropy.apply(z, tok, with_entropy, topk), _sum_squared_probs(z) if with_sum_pi_squared else None))
    logp, ent, top_logp, top_ids, spsq = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
    return logp, ent, spsq, top_logp, top_ids                              # [N] each ([N, k] the top-k ones)


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                 banned: list[int] | None, dtype: torch.dtype | None = None,
                 support: Support | None = None) -> torch.Tensor:
    """Logits / T [chunk, vocab] of hidden states [chunk, hidden], the matmul in `weight`'s dtype, in `dtype`
    (None: float32, or float64 for a float64 weight)."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    z = z.to(dtype or torch.promote_types(weight.dtype, torch.float32))
    return only_supported(mask_logits(z if temperature == 1.0 else z.div_(temperature), banned), support)


@dataclass
class Support:
    """The ids each of N positions was sampled from, where not the whole vocabulary: the sampler's top-k / top-p
    kept set and, at the positions sampled under a decoding grammar, the ids it allowed (both where both)."""
    kept: torch.Tensor | None = None   # [N, k] ids, -1 padded; a row of all -1: every id
    at: torch.Tensor | None = None     # [m] long, ascending: the positions sampled under a grammar
    bits: torch.Tensor | None = None   # [m, words] int32: their allowed ids, bit i of word w is id 32w + i

    @staticmethod
    def at_tokens(rows: torch.Tensor, cols: torch.Tensor, shape, kept: torch.Tensor | None,
                  grammar: list[dict] | None) -> Support | None:
        """The support of the response tokens (rows, cols) [N] of a [batch, resp_len] response (`shape`), from the
        batch's kept sets [batch, resp_len, k] and per-row grammar masks (RolloutBatch.grammar_masks); None: none."""
        kept = None if kept is None else kept.to(rows.device)[rows, cols]  # [N, k]
        spans = [(r, g) for r, g in enumerate(grammar or []) if g]
        if not spans:
            return None if kept is None else Support(kept)
        index = torch.full(shape, -1, dtype=torch.long, device=rows.device)
        index[rows, cols] = torch.arange(len(rows), device=rows.device)   # [batch, resp_len]: position of each token
        at = torch.cat([index[r, g["cols"].to(rows.device)] for r, g in spans])  # [m], ascending (row-major)
        bits = torch.cat([g["bits"] for _, g in spans]).to(rows.device)          # [m, words]
        if (at < 0).any():
            raise ValueError("a grammar-constrained position is not a response token of its row")
        return Support(kept, at, bits)

    def __getitem__(self, rows: slice) -> Support | None:
        """Positions [rows.start, rows.stop) (a chunk); None where nothing there was filtered (no mask to build)."""
        kept = None if self.kept is None else self.kept[rows]
        if self.at is None:
            return Support(kept)
        lo, hi = torch.searchsorted(self.at, torch.tensor([rows.start, rows.stop], device=self.at.device)).tolist()
        if lo == hi:
            return None if kept is None else Support(kept)
        return Support(kept, self.at[lo:hi] - rows.start, self.bits[lo:hi])


def _chunks(support: Support | None, chunk: int):
    """`support` a chunk of positions at a time (None forever where there is none)."""
    return itertools.repeat(None) if support is None else (support[i:i + chunk] for i in itertools.count(0, chunk))


def only_supported(z: torch.Tensor, support: Support | None) -> torch.Tensor:
    """Logits z [N, vocab] with every id outside its position's support set to -1e30, as mask_logits bans a token:
    the softmax is then the sampler's distribution (top-k / top-p, a grammar's allowed set), renormalised over the
    set, and the entropy and gradients stay finite. Where nothing filtered, the whole vocabulary (the tokens an agent
    loop inserted, and every token of a run that samples from the whole vocabulary). One chunk's [N, vocab] mask at
    most: the grammar's bits are unpacked here, for these positions only."""
    if support is None:
        return z
    kept = support.kept
    if kept is None:
        allowed = torch.ones(z.shape, dtype=torch.bool, device=z.device)              # [N, vocab]
    else:
        allowed = torch.zeros(len(z), z.shape[-1] + 1, dtype=torch.bool, device=z.device)  # [N, vocab + 1]
        allowed.scatter_(1, kept.masked_fill(kept < 0, z.shape[-1]), True)           # padding lands in the spare column
        allowed = allowed[:, :-1] | (kept < 0).all(-1, keepdim=True)                  # [N, vocab]
    if support.at is not None:
        allowed[support.at] &= unpack(support.bits, support.bits.shape[1] * 32, z.shape[-1])  # [m, vocab]
    return torch.where(allowed, z, -1e30)


class _HeadLogpEntropy(torch.autograd.Function):
    """hidden [N, hidden] -> log-prob of each token and entropy [N] under softmax((hidden W^T + b) / T),
    `chunk` tokens at a time: one chunk's logits exist at once, in the backward too, which recomputes
    them and writes the gradients of hidden, W and b out. The logits' gradients of `GRAD_BUDGET` bytes of
    chunks go through one matmul per weight, and W's gradient is summed in place: autograd through a
    checkpoint made a [vocab, hidden] tensor per chunk, a pass over memory as costly as the chunk's matmuls.

    The values are float32 logits' (`_chunked`'s); the gradient is computed in `grad_dtype`, the autocast
    dtype under mixed precision: there the recomputed logits are bf16 matmuls' (4-5x faster on AMX or
    tensor cores), softmax'ed in float32, as the body's gradients are bf16 approximations of its function."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, with_entropy: bool, chunk: int,
                banned: list[int] | None, grad_dtype: torch.dtype, topk: int = 0, support: Support | None = None):
        parts = []
        with torch.autocast(hidden.device.type, enabled=False):
            for h, tok, keep in zip(hidden.split(chunk), tokens.split(chunk), _chunks(support, chunk)):
                z = _head_logits(h, weight, bias, temperature, banned, support=keep)
                parts.append(_logp_entropy(z, tok, with_entropy, topk))
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.args = temperature, chunk, banned, grad_dtype, support  # the support takes no gradient
        ctx.set_materialize_grads(False)
        logp, ent, top_logp, top_ids = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
        ctx.mark_non_differentiable(*(t for t in (top_logp, top_ids) if t is not None))
        return logp, ent, top_logp, top_ids                                     # [N](, m) [N] [N, k] [N, k]

    @staticmethod
    def backward(ctx, g_logp, g_ent, *_top):
        hidden, weight, bias, tokens = ctx.saved_tensors
        temperature, chunk, banned, dtype, support = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None and g_ent is None:
            return (None,) * 11
        # the forward's float32 logits again, or the compute dtype's (mixed precision)
        logits_dtype = None if dtype == weight.dtype else dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        group = max(1, GRAD_BUDGET // (weight.shape[0] * dtype.itemsize) // chunk) * chunk
        grad_h = torch.empty_like(hidden) if need_h else None                   # [N, hidden]
        grad_w = torch.zeros_like(weight) if need_w else None                   # [vocab, hidden]
        grad_b = torch.zeros_like(bias) if need_b else None                     # [vocab]
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(hidden), group):
                h = hidden[start:start + group].to(dtype)                        # [group, hidden]
                g = torch.empty(len(h), weight.shape[0], dtype=dtype, device=h.device)  # [group, vocab]
                for c in range(0, len(h), chunk):
                    rows = slice(start + c, start + c + chunk)
                    z = _head_logits(h[c:c + chunk], w, b, temperature, banned, logits_dtype,
                                     None if support is None else support[rows])  # [chunk, vocab]
                    g[c:c + chunk] = _logits_grad(z, tokens[rows], None if g_logp is None else g_logp[rows],
                                                  None if g_ent is None else g_ent[rows])
                if need_h:
                    grad_h[start:start + group].copy_(g @ w)
                if need_w:
                    grad_w.addmm_(g.t(), h) if dtype == grad_w.dtype else grad_w.add_(g.t() @ h)
                if need_b:
                    grad_b.add_(g.sum(0, dtype=grad_b.dtype))
        if temperature != 1.0:  # d/dz of f(z / T): the logits' gradient over T, applied to the sums
            for grad in (grad_h, grad_w, grad_b):
                if grad is not None:
                    grad.div_(temperature)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _logp_entropy(z: torch.Tensor, tokens: torch.Tensor, with_entropy: bool, topk: int = 0):
    """log softmax(z) at `tokens` ([chunk] or [chunk, m]: the same shape out), the entropy [chunk] (None unless
    asked) and the k most likely tokens' log-probs and ids [chunk, k] (None without `topk`) of logits z [chunk, vocab]."""
    logq = torch.log_softmax(z, -1)                                              # [chunk, vocab]
    logp = logq.gather(-1, _per_row(tokens)).view(tokens.shape)
    top = logq.topk(topk, -1) if topk else (None, None)
    return logp, -logq.exp().mul_(logq).sum(-1) if with_entropy else None, top[0], top[1]


def _per_row(t: torch.Tensor) -> torch.Tensor:
    """Tokens (or their gradients) [chunk] or [chunk, m] as [chunk, m]; a chunk of no rows too (a micro-batch with no
    response token: every row a failed agent session), where view(0, -1) is ambiguous."""
    return t.view(len(t), -1) if len(t) else t.view(0, t.shape[1] if t.dim() > 1 else 1)


def _logits_grad(z: torch.Tensor, tokens: torch.Tensor, g_logp: torch.Tensor | None,
                 g_ent: torch.Tensor | None) -> torch.Tensor:
    """The float32 gradient [chunk, vocab] at logits z [chunk, vocab] (any float dtype) of
    sum_j g_logp_j . log softmax(z)[token_j] + g_ent . entropy (tokens and g_logp [chunk] or [chunk, m]):
    d logp/dz = onehot - p;  d ent/dz = -p (log p + ent)."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    g_tok = None if g_logp is None else _per_row(g_logp)                        # [chunk, m]
    g_sum = None if g_tok is None else g_tok.sum(-1, keepdim=True)              # [chunk, 1]
    if g_ent is None:
        g = torch.softmax(z, -1, dtype=dtype).mul_(-g_sum)                     # [chunk, vocab]
    else:  # -p (log p + ent) g_ent - p g_logp
        logq = torch.log_softmax(z, -1, dtype=dtype)                    # [chunk, vocab]
        p = logq.exp()
        ent = -(p * logq).sum(-1)                                               # [chunk]
        g = logq.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
        if g_sum is not None:
            g.sub_(p.mul_(g_sum))
    if g_tok is not None:
        g.scatter_add_(-1, _per_row(tokens), g_tok.to(g.dtype))
    return g


def _sum_squared_probs(z: torch.Tensor) -> torch.Tensor:
    """sum over the vocabulary of softmax(z)^2 [chunk] for logits z [chunk, vocab]."""
    return torch.softmax(z, -1).square().sum(-1)


class _LogpEntropy(torch.autograd.Function):
    """z [chunk, vocab] -> (z[token] - logsumexp z, entropy of softmax z) [chunk] and the top-k (no gradient),
    the gradient by hand (`_logits_grad`), one pass over the logits instead of autograd's several."""

    @staticmethod
    def forward(ctx, z, tokens, with_entropy: bool, topk: int = 0):
        logp, ent, top_logp, top_ids = _logp_entropy(z, tokens, with_entropy, topk)
        ctx.save_for_backward(z, tokens)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in (top_logp, top_ids) if t is not None))
        return logp, ent, top_logp, top_ids

    @staticmethod
    def backward(ctx, g_logp, g_ent, *_top):
        z, tokens = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None
        return _logits_grad(z, tokens, g_logp, g_ent), None, None, None
