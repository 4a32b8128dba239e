"""A local Tinker: the Tinker training API (Thinking Machines' `tinker` SDK, 0.38) on `plait serve`'s server.

    routes.py   the /api/v1 endpoints, sessions, futures, the one worker thread that runs the jobs, and the journal
                a restart reads back (server.jsonl in the Tinker dir)
    trainer.py  the base model, a LoRA adapter per training client and per sampler, AdamW, tinker:// checkpoints,
                the samplers' rollout engine
    losses.py   the built-in losses as the SDK documents them (pure functions)
    wire.py     the SDK's protobuf bodies in and out

`tinker_api(...)` builds it for a model folder; `plait serve` mounts its routes beside the OpenAI-compatible
ones, in the same process. docs/tinker.md says what runs and what is refused.
"""

from __future__ import annotations


def tinker_api(path: str, name: str, tokenizer, eos_ids: list[int], root: str, max_tokens: int, engine_cfg=None,
               profiler=None, batch_tokens: int | None = None):
    """The Tinker endpoints over the model at `path` served as `name`; checkpoints under `root`; samplers on the
    engine `engine_cfg` (a rollout node) names, recording into `profiler` (the rollout role's); `batch_tokens`: the
    most padded tokens a forward / backward pass runs at once (None: trainer.BATCH_TOKENS)."""
    from plait.serving.tinker.routes import TinkerApi
    from plait.serving.tinker.trainer import BATCH_TOKENS, TinkerTrainer
    trainer = TinkerTrainer(path, name, tokenizer, eos_ids, root, engine_cfg, profiler, max_tokens, batch_tokens or BATCH_TOKENS)
    return TinkerApi(trainer, max_tokens)
