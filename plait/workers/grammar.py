"""Grammar-constrained decoding: a JSON schema, alone or between fixed text (a forced tool call's tags), as an
llguidance grammar over the served tokenizer, and the set of tokens it allows next.

The hf engine (workers/rollout_engine.py) keeps one matcher per row: before each draw the tokens the grammar does
not allow get a -inf logit, so the token and its log-prob are both under softmax over the allowed set; after the
draw the row's matcher takes the token. A complete grammar allows only EOS. JSON is written with fixed separators
(", " and ": ", as json.dumps writes it) and no free whitespace: a model cannot stall in a run of blanks.

Training: a session's reply sampled under a grammar is replayed (`Grammar.replay`: the allowed set before each
sampled token, packed 32 ids a bit-word) when it becomes a batch row (RolloutBatch.grammar_masks), and the trainer's
log-probs are the softmax over that set (plait/workers/logprobs.py Support). A request cut by a weight sync goes on
from the matcher after its tokens so far (`Grammar.after`).

On vLLM (workers/vllm_engine.py) the grammar's lark source goes to vLLM's structured outputs (guidance backend, the
same llguidance), a resumed request's with the tokens `after` took (`Grammar.done`; plait's vLLM plugin feeds them to
vLLM's matcher). The engine table says which engines take a grammar.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "llguidance is not installed: pip install 'plait[constrained]'"


@dataclass(frozen=True)
class Grammar:
    """One compiled constraint; equal grammars share an engine batch (sampling settings group requests)."""
    text: str                            # llguidance's grammar
    vocab: int                           # its tokenizer's size
    start: Any = field(compare=False)    # an LLMatcher at the grammar's start, never advanced: rows take copies
    lark: str = ""                       # its lark source (vLLM's structured outputs take lark, not `text`)
    done: tuple[int, ...] = ()           # tokens `start` has taken (`after`): vLLM's matcher takes them first

    def matcher(self):
        """A fresh matcher for one row (a copy: compiling the grammar again would cost more)."""
        return self.start.deep_copy()

    def after(self, tokens: list[int]) -> Grammar:
        """This grammar with its start after `tokens` (a request resumed after an abort goes on where it was cut)."""
        m = self.matcher()
        if tokens and not m.consume_tokens(tokens):
            raise RuntimeError(f"the decoding grammar does not take the tokens sampled so far: {m.get_error()}")
        return Grammar(self.text, self.vocab, m, self.lark, self.done + tuple(tokens))

    def allowed(self, matchers: list, width: int) -> torch.Tensor:
        """[rows, width] bool: the tokens each row's matcher allows next (a None row: all of them); ids past the
        tokenizer's (a model's padded vocabulary) never."""
        import torch  # (not llguidance.torch: importing it compiles a kernel plait does not use)
        words = torch.full((len(matchers), (self.vocab + 31) // 32), -1, dtype=torch.int32)  # [rows, words]
        for i, m in enumerate(matchers):
            if m is not None:
                m.unsafe_compute_mask_ptr(words[i].data_ptr(), words.shape[1] * 4)  # row i, in place
                if m.is_error():
                    raise RuntimeError(f"the decoding grammar failed: {m.get_error()}")
        return unpack(words, self.vocab, width)

    def replay(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), words] int32: the allowed set before each of `tokens` (bit i of word w: id 32w + i), the
        grammar's matcher replayed from its start. ValueError naming the first token the grammar does not allow."""
        import torch
        m, words = self.matcher(), torch.empty((len(tokens), (self.vocab + 31) // 32), dtype=torch.int32)
        for i, t in enumerate(tokens):
            m.unsafe_compute_mask_ptr(words[i].data_ptr(), words.shape[1] * 4)
            if not (0 <= t < self.vocab and int(words[i, t >> 5]) >> (t & 31) & 1 and m.consume_token(t)):
                raise ValueError(f"sampled token {i} of {len(tokens)} (id {t}) is not one its decoding grammar allows"
                                 f"{': ' + m.get_error() if m.is_error() else ''}")
        if self.vocab % 32:  # the last word's ids past the tokenizer's: never (a padded vocabulary's ids)
            words[:, -1] &= (1 << self.vocab % 32) - 1
        return words


class Grammars:
    """Grammars over one tokenizer, which llguidance reads at the first (about a second for a large vocabulary).
    `eos_ids`: the engine's stop tokens, what a complete grammar allows (empty: the tokenizer's EOS)."""

    def __init__(self, tokenizer, eos_ids: list[int]):
        self.hf_tokenizer, self.eos_ids = tokenizer, list(eos_ids)

    @functools.cached_property
    def tokenizer(self):
        import llguidance.hf
        return llguidance.hf.from_tokenizer(self.hf_tokenizer, eos_token=self.eos_ids or None)

    def json(self, answers: list[tuple[str, dict, str]]) -> Grammar:
        """Any one of `answers` (head, schema, tail): the text `head`, JSON valid under `schema`, then `tail`.
        ValueError with llguidance's reason where a schema does not compile."""
        from llguidance import LLMatcher
        rules = [f"start: {' | '.join(f'a{i}' for i in range(len(answers)))}"]
        for i, (head, schema, tail) in enumerate(answers):
            own = schema.get("x-guidance")
            body = json.dumps({**schema, "x-guidance": {**JSON_STYLE, **(own if isinstance(own, dict) else {})}})
            rules += [f"a{i}: " + " ".join([json.dumps(head)] * bool(head) + [f"j{i}"] + [json.dumps(tail)] * bool(tail)),
                      f"j{i}: %json {body}"]
        lark = "\n".join(rules)
        text = LLMatcher.grammar_from_lark(lark)
        start = LLMatcher(self.tokenizer, text, log_level=0)
        if start.is_error():
            raise ValueError(start.get_error().splitlines()[0][:300])
        return Grammar(text, self.tokenizer.vocab_size, start, lark)


def unpack(words: torch.Tensor, vocab: int, width: int) -> torch.Tensor:
    """Bit-words [rows, ceil(vocab / 32)] int32 -> [rows, width] bool; ids from `vocab` on (a padded vocabulary): False."""
    import torch
    # byte by byte through a table of each byte's 8 bits: half the time of shifting every word 32 times (a chunk of
    # 170 rows of 49,152 ids: 11 ms, single-threaded CPU); the bytes of a word in memory order (little-endian)
    table = ((torch.arange(256, device=words.device)[:, None] >> torch.arange(8, device=words.device)) & 1).bool()
    ok = table[words.contiguous().view(torch.uint8).long()].flatten(1)[:, :min(vocab, width)]  # [rows, vocab]
    return torch.nn.functional.pad(ok, (0, width - ok.shape[1]), value=False)                # [rows, width]


def masks(response_ids: list[int], segments: list, limit: int) -> dict:
    """A response's grammar segments [(start, end, Grammar)] replayed over its tokens, as a batch row carries them
    (RolloutBatch.grammar_masks): {"cols": [m] long, "bits": [m, words] int32}, cut at `limit` columns; {}: none."""
    import torch
    cols, bits = [], []
    for start, end, grammar in segments:
        bits.append(grammar.replay(response_ids[start:end]))
        cols.append(torch.arange(start, end))
    if not cols:
        return {}
    cols, bits = torch.cat(cols), torch.cat(bits)
    keep = cols < limit
    return {"cols": cols[keep], "bits": bits[keep]} if keep.any() else {}


def unavailable() -> Optional[str]:
    """None where llguidance imports; else the one-line install hint."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return INSTALL
    return None
