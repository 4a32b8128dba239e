"""Helpers of the gateway tests (imported by name: a module called `conftest` is ambiguous across test
folders). A gateway served on 127.0.0.1 over a scripted engine (the engine seam's test double: each request's answer is
script(text of the prompt)), for the protocol and session tests; the real model runs in test_serve.py and the
training tests."""

import threading
from contextlib import contextmanager

import torch

from plait.agents.runner import EventLoopThread, Scheduler, run_round
from plait.serving.gateway import Gateway
from plait.serving.server import Server
from plait.workers.rollout_engine import Generation

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
          "{% for c in m.get('tool_calls', []) %}[call {{ c['function']['name'] }}]{% endfor %}<|end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class Scripted:
    """engine_round: the answer to each prompt is script(its text) and EOS (or the ids script returns), log-prob
    -0.5 a token."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.prompts, self.rounds = tokenizer, script, [], []
        self.cut_after: int | None = None  # the next round stops after this many tokens a row, as a weight sync's abort
        self.version = 0

    def __call__(self, ids, max_new_tokens, sampling):
        self.rounds.append(len(ids))
        rows = []
        for p in ids:
            text = self.tok.decode(p)
            self.prompts.append(text)
            head, mark, partial = text.rpartition("<|assistant|>")  # a request resumed after an abort: its tokens so far
            answer = self.script(head + mark if mark else text)  # text (then EOS), or the token ids themselves
            if isinstance(answer, str):
                answer = answer[len(partial):] if mark and answer.startswith(partial) else answer
            ids = answer if isinstance(answer, list) else self.tok.encode(answer, add_special_tokens=False) + [self.tok.eos_token_id]
            rows.append(ids[:max_new_tokens])
        width = max(1, max(len(r) for r in rows))
        out, mask = torch.full((len(rows), width), self.tok.pad_token_id), torch.zeros(len(rows), width)
        reasons = []
        for i, r in enumerate(rows):
            k = min(len(r), self.cut_after or len(r))
            out[i, :k], mask[i, :k] = torch.tensor(r[:k]), 1
            reasons.append("aborted" if k < len(r) else "eos" if r[-1] == self.tok.eos_token_id else "length")
        self.cut_after = None
        return Generation(out, mask, -0.5 * mask, reasons)


def tool_then_answer(text: str) -> str:
    return "#### 5" if "<|tool|>" in text else CALL


@contextmanager
def served(tokenizer, script=tool_then_answer, plain=True, version=lambda: 0, limits=None):
    """(gateway, url, engine): a Gateway with its server (bounded by `limits`, plait/serving/server.py's Limits),
    and a thread running the queue's rounds."""
    thread, queue, stop = EventLoopThread(), Scheduler(512), threading.Event()
    engine = Scripted(tokenizer, script)
    gateway = Gateway(tokenizer, "qwen2", "hermes", [tokenizer.eos_token_id], "tiny",
                      generate=queue.generate if plain else None, max_tokens=200)
    server = Server(gateway, thread.loop, limits=limits)

    def drive():
        while not stop.is_set():
            requests = queue.take(lambda: 1 << 30, 0.01, stop.is_set)
            if requests:
                run_round(requests, engine, version())
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        yield gateway, server.url, engine, queue
    finally:
        stop.set()
        queue.notify()
        driver.join(5)
        server.close()
        thread.close()
