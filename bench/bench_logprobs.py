"""The LM-head part of a log-prob pass, before and after plait/workers/logprobs.py, in one process.

SmolLM2-135M-Instruct's shapes (hidden 576, vocabulary 49152), 16 rows of 160 prompt + 32 response
tokens, forward and backward of a loss on log-probs and entropy, from the last hidden state on:
- full: logits at every position, sliced to the response (plait before);
- chunked_autograd: response positions only, per-chunk checkpointing, autograd through the softmax;
- chunked_checkpointed: response positions only, per-chunk checkpointing, the softmax's gradient by hand
  (plait before the fused head; still its path for a head that is not a plain Linear);
- chunked: response positions only, the head's backward written out (`_HeadLogpEntropy`, plait now).
Median seconds of `--repeats` alternating runs, one thread, and the ratio to `full`. `--dtype bfloat16`:
each runs under bf16 autocast, as a mixed-precision update does (plait's values stay float32 logits';
its fused backward computes in bf16).

    python bench/bench_logprobs.py [--repeats 5] [--dtype float32] [--out bench/results/logprobs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from machine import capability
from plait.algorithms.losses import entropy_from_logits, token_logprobs
from plait.workers.logprobs import chunked_logprobs

ROWS, PROMPT, RESP, HIDDEN, VOCAB, T = 16, 160, 32, 576, 49152, 0.7


def full(hidden, tokens, head):
    logits = head(hidden)[:, PROMPT - 1:-1].float() / T                     # all positions, then the slice
    return token_logprobs(logits, tokens), entropy_from_logits(logits)


def chunked_autograd(hidden, tokens, head, chunk=170):
    h, tok = hidden[:, PROMPT - 1:-1].flatten(0, 1), tokens.flatten()

    def one(h, tok):
        z = head(h).float() / T
        return token_logprobs(z, tok), entropy_from_logits(z)
    parts = [checkpoint(one, a, b, use_reentrant=False) for a, b in zip(h.split(chunk), tok.split(chunk))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class _NotPlainLinear(torch.nn.Linear):
    """A head plait does not fuse: its per-chunk checkpoint path."""


def chunked_checkpointed(hidden, tokens, head):
    other = _NotPlainLinear(HIDDEN, VOCAB, bias=False)
    other.weight = head.weight
    return chunked_logprobs(hidden[:, PROMPT - 1:-1].flatten(0, 1), tokens.flatten(), other, T, True)


def chunked(hidden, tokens, head):
    return chunked_logprobs(hidden[:, PROMPT - 1:-1].flatten(0, 1), tokens.flatten(), head, T, True)


VARIANTS = (full, chunked_autograd, chunked_checkpointed, chunked)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "logprobs.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(args.rows, PROMPT + RESP, HIDDEN, requires_grad=True)
    tokens = torch.randint(0, VOCAB, (args.rows, RESP))
    weights = torch.randn(args.rows, RESP)
    times = {f.__name__: [] for f in VARIANTS}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for f in VARIANTS:
            head.zero_grad(), hidden.grad is not None and hidden.grad.zero_()
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                logp, ent = f(hidden, tokens, head)
            ((logp.view(-1) * weights.view(-1)).sum() + 0.01 * ent.sum()).backward()
            times[f.__name__].append(time.perf_counter() - start)
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    result = {"shapes": {"rows": args.rows, "prompt": PROMPT, "response": RESP, "hidden": HIDDEN, "vocab": VOCAB},
              "dtype": args.dtype, "capability": capability(), "threads": 1, "repeats": args.repeats, "median_s": med,
              "speedup_vs_full": {k: round(med["full"] / v, 2) for k, v in med.items()},
              "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
