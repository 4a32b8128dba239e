"""Grammar-constrained decoding: a JSON schema, alone or between fixed text (a forced tool call's tags), as an
llguidance grammar over the served tokenizer, and the set of tokens it allows next.

The hf engine (workers/rollout_engine.py) keeps one matcher per row: before each draw the tokens the grammar does
not allow get a -inf logit, so the token and its log-prob are both under softmax over the allowed set; after the
draw the row's matcher takes the token. A complete grammar allows only EOS. JSON is written with fixed separators
(", " and ": ", as json.dumps writes it) and no free whitespace: a model cannot stall in a run of blanks.

Left out: vLLM's own structured outputs (the engine table says which engines take a grammar), and the trainer's
side: training sessions refuse constraints (docs/agents.md "Forced tool calls and structured output").
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

    def matcher(self):
        """A fresh matcher for one row (a copy: compiling the grammar again would cost more)."""
        return self.start.deep_copy()

    def allowed(self, matchers: list, width: int) -> torch.Tensor:
        """[rows, width] bool: the tokens each row's matcher allows next (a None row: all of them); ids past the
        tokenizer's (a model's padded vocabulary) never."""
        import torch  # (not llguidance.torch: importing it compiles a kernel plait does not use)
        vocab = self.vocab
        words = torch.full((len(matchers), (vocab + 31) // 32), -1, dtype=torch.int32)  # [rows, words] 32 ids each
        for i, m in enumerate(matchers):
            if m is not None:
                m.unsafe_compute_mask_ptr(words[i].data_ptr(), words.shape[1] * 4)  # row i, in place
                if m.is_error():
                    raise RuntimeError(f"the decoding grammar failed: {m.get_error()}")
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1          # [rows, words, 32]
        ok = bits.flatten(1)[:, :min(vocab, width)].bool()                             # [rows, vocab]
        return torch.nn.functional.pad(ok, (0, width - ok.shape[1]), value=False)      # [rows, width]


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
        text = LLMatcher.grammar_from_lark("\n".join(rules))
        start = LLMatcher(self.tokenizer, text, log_level=0)
        if start.is_error():
            raise ValueError(start.get_error().splitlines()[0][:300])
        return Grammar(text, self.tokenizer.vocab_size, start)


def unavailable() -> Optional[str]:
    """None where llguidance imports; else the one-line install hint."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return INSTALL
    return None
