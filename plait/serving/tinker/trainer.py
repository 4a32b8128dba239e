"""The training side of the local Tinker: one base model, a LoRA adapter (peft) per training client, a frozen copy
of its weights per sampler, each client's own AdamW, and `tinker://` checkpoints in a local folder.

Clients never mix: each is an adapter of its own name in one PeftModel, made active for its requests only
(peft runs only the active adapter, so no other adapter's weights take part or get gradients), with an
optimizer over its own parameters. A sampler (`save_weights_and_get_sampling_client`) is a frozen copy of
the client's adapter tensors at that moment (`snapshots`), so later training does not move what it samples. It is
no adapter of the model: an RL loop makes one every step, and every adapter in the model is on every request's path
(peft's set_adapter, the adapter's parameter lookup), so a step would cost more with each step before it.

A client created with LoRA rank 0 (as SkyRL reads it: full fine-tuning) trains every weight of its own copy of the
served model (one more model in memory, and AdamW's two moments of it); the shared base stays as it is for the
LoRA clients. Its samplers are frozen copies of its whole state dict, the last KEPT_FULL_SNAPSHOTS per client
(older ones are dropped: a model copy each); a LoRA client keeps its last KEPT_LORA_SNAPSHOTS (an adapter copy each:
an RL loop makes one a step, so memory would otherwise grow with every step). A dropped sampler's request is a 400
saying so; `save_weights_for_sampler(name)` keeps one on disk. Its checkpoints hold `model/`, a Hugging Face folder (weights,
config, tokenizer), in place of `adapter/`.

Samples are drawn by a plait rollout engine (a Rollout worker over the ENGINES row the server was started
with: hf, or vLLM where installed), which holds one sampler's weights at a time: the base model with that
sampler's adapter merged (models.merged_state_dict, as the actor hands its rollout; the snapshot is copied into
one adapter per LoRA shape, `slots`, to be merged), loaded with `load_weights` when a request comes for another
sampler than the one it holds (sharing the tensors, no copy: none of them is ever written again). The engine's
model is the served folder with its output head untied from the embeddings (a LoRA on a tied head changes the head only,
as peft does). A sample's log-probs are the model's own at temperature 1, what `compute_logprobs` and
`forward` give for the same tokens (on-policy by construction): the engine's sampled log-probs where they are
those (temperature 1 without top-k / top-p, or greedy), else the engine's scoring of the tokens
(`probe_logprobs`), which also gives the prompt's.

A `forward` / `forward_backward` runs its data in pieces of at most `batch_tokens` padded tokens (rows x the
longest; `plait serve --tinker-batch-tokens`, default BATCH_TOKENS; data of about one length together), the
gradients adding up over the pieces: the
outputs and gradients of one pass over the whole request, within float rounding, in the memory of one piece. A
non-finite loss in any piece refuses the whole request with the gradients as they were before it.

Every method here runs on the service's one worker thread (routes.py), so requests never race.
`tinker://RUN/weights/NAME` (save_state: adapter + optimizer) and `tinker://RUN/sampler_weights/NAME`
(adapter only) are the folders ROOT/RUN/weights/NAME and ROOT/RUN/sampler_weights/NAME: `state.pt` for this server,
and `adapter/`, the adapter as peft saves one, for anything else that loads peft adapters.

Left out: top-k and prompt-token alternatives, stop tokens that let a sample run past EOS (the engine ends a sample at EOS; other stop tokens and
strings cut it after).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from plait.algorithms.losses import token_logprobs
from plait.serving.protocol import ApiError
from plait.serving.tinker.losses import LOSSES
from plait.serving.tinker.wire import FwdBwd, encode_forward_backward, encode_sample

LORA_ALPHA = 32  # Tinker's LoRA scale is alpha / rank with alpha 32
STATE_FILE = "state.pt"
FULL_DIR = "model"  # a full fine-tuning checkpoint's weights, as a Hugging Face folder
KEPT_FULL_SNAPSHOTS = 2  # a full fine-tuning client's newest samplers kept (each a copy of the model)
KEPT_LORA_SNAPSHOTS = 32  # a LoRA client's (each a copy of its adapter): more than an off-policy loop looks back
BATCH_TOKENS = 1024  # padded tokens in one forward / backward pass (`plait serve --tinker-batch-tokens`; docs/tinker.md)


@dataclass
class Lora:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass
class Client:
    """A training client: its adapter's name, its parameters (by name with the adapter named `{}`), its optimizer;
    for full fine-tuning (rank 0) its own model, every parameter of which it trains, and no adapter."""
    model_id: str
    adapter: str | None
    lora: Lora
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    steps: int = 0
    model: torch.nn.Module | None = None
    snapshots: list[str] = field(default_factory=list)  # its samplers' keys, oldest first


@dataclass
class Sampler:
    weights: str | None           # its key in TinkerTrainer.snapshots; None: the base model
    model_path: str | None = None
    lora: Lora | None = None


@dataclass
class SampleParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: set[int] = field(default_factory=set)
    stop_strings: list[str] = field(default_factory=list)


UNLOADED = "(none)"  # what the engine holds before its first load (never a sampler's adapter name)


class TinkerTrainer:
    def __init__(self, path: str, name: str, tokenizer, eos_ids: list[int], root: str, engine_cfg=None, profiler=None,
                 max_tokens: int = 1024, batch_tokens: int = BATCH_TOKENS):
        """`engine_cfg`: the rollout node naming the samplers' engine (None: plait's own, hf); `profiler`: the
        rollout role's handle the engine records into; `batch_tokens`: the most padded tokens (rows x the longest) a
        forward / forward_backward runs at once."""
        from transformers import AutoConfig
        self.path, self.name, self.tokenizer, self.eos_ids, self.root = path, name, tokenizer, eos_ids, root
        self.engine_cfg, self.profiler, self.max_tokens, self.batch_tokens = engine_cfg, profiler, max_tokens, batch_tokens
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        text = config.get_text_config()  # a VL model's language part (the config itself for a causal LM)
        self.arch, self.vocab, self.tied = config.model_type, text.vocab_size, config.tie_word_embeddings
        self.context = getattr(text, "max_position_embeddings", None)  # not every architecture names one
        self.model = None  # loaded by the first request that needs it (base())
        self.linears: dict[str, list[str]] = {"mlp": [], "attn": [], "unembed": []}
        self.peft = None
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, Sampler] = {}
        # samplers' frozen weights: a LoRA's adapter tensors (by name with the adapter named `{}`) or a full state dict
        self.snapshots: dict[str, dict[str, torch.Tensor] | None] = {}  # (None: dropped)
        self.slots: dict[tuple, tuple[str, dict]] = {}  # per LoRA shape: the adapter (name, params) snapshots merge through
        self.adapters = 0
        self.rollout = None  # the samplers' engine (a Rollout worker), built by the first sample
        self.loaded: str | None = UNLOADED  # whose weights it holds: a sampler's adapter, None for the base model

    # -- adapters -------------------------------------------------------------------------------------------------
    def base(self):
        """The served model, loaded on first use: a `plait serve` that is never asked to train holds no second copy."""
        from plait.models import load_causal_lm
        if self.model is None:
            self.model = load_causal_lm(self.path).eval()  # eval: no dropout; gradients still flow to the adapters
            self.model.requires_grad_(False)
            for mod_name, module in self.model.named_modules():
                if isinstance(module, torch.nn.Linear):
                    kind = "unembed" if mod_name.split(".")[-1] == "lm_head" else "mlp" \
                        if ".mlp." in f".{mod_name}." else "attn" if "attn" in mod_name else None
                    if kind:
                        self.linears[kind].append(mod_name)
        return self.model

    def _add_adapter(self, lora: Lora) -> str:
        from peft import LoraConfig, get_peft_model
        from plait.models import peft_quiet
        self.base()
        targets = [m for kind in ("mlp", "attn", "unembed") if getattr(lora, f"train_{kind}") for m in self.linears[kind]]
        if not targets:
            raise ApiError(400, f"lora_config trains nothing on this model (its linear layers: "
                                f"{ {k: len(v) for k, v in self.linears.items()} })", param="lora_config")
        name = f"a{self.adapters}"  # peft's adapter names are module keys: no dots or colons
        self.adapters += 1
        config = LoraConfig(r=lora.rank, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0, bias="none")
        with torch.random.fork_rng(devices=[]), peft_quiet(), warnings.catch_warnings():
            # peft warns that a LoRA on a head tied to the embeddings leaves the embeddings as they are: as meant here
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            torch.manual_seed(lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little"))
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        return name

    def _params(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        tag = f".{adapter}."
        return {n.replace(tag, ".{}."): p for n, p in sorted(self.peft.named_parameters()) if tag in n}

    # -- training clients -----------------------------------------------------------------------------------------
    def create(self, model_id: str, lora: Lora) -> dict:
        model, adapter = None, None
        if lora.rank == 0:  # full fine-tuning: its own copy of the served model, every parameter trained
            from plait.models import load_causal_lm
            model = load_causal_lm(self.path).eval()  # eval: no dropout
            params = dict(model.named_parameters())
        else:
            adapter = self._add_adapter(lora)
            params = self._params(adapter)
        self.clients[model_id] = Client(model_id, adapter, lora, params, torch.optim.AdamW(params.values(), weight_decay=0.0),
                                        model=model)
        return {"model_id": model_id, "type": "create_model"}

    def _client_net(self, client: Client):
        """The model the client trains: its own (full), or the shared one with its adapter active; a context manager."""
        if client.model is not None:
            return contextlib.nullcontext(client.model)
        self.peft.base_model.set_adapter(client.adapter)
        for p in client.params.values():  # set_adapter freezes the others; its own must train
            p.requires_grad_(True)
        return contextlib.nullcontext(self.peft)

    def info(self, model_id: str) -> dict:
        client = self.clients[model_id]
        full = client.model is not None
        return {"type": "get_info", "model_id": model_id, "is_lora": not full, "lora_rank": None if full else client.lora.rank,
                "model_name": self.name, "model_data": {"arch": self.arch, "model_name": self.name,
                                                        "tokenizer_id": self.path}}

    @staticmethod
    def logprobs(net, rows: list[tuple[list[int], list[int] | torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
        """Log-probs [rows, longest] of the rows right-padded into one batch (pad positions: the pad token's), and
        each row's length."""
        lengths = [len(tokens) for tokens, _ in rows]
        ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        targets = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for i, (tokens, target) in enumerate(rows):
            ids[i, :len(tokens)] = torch.as_tensor(tokens)
            targets[i, :len(tokens)] = torch.as_tensor(target)
            mask[i, :len(tokens)] = 1
        logits = net(input_ids=ids, attention_mask=mask).logits  # [batch, n, vocab]
        return token_logprobs(logits, targets), lengths  # [batch, n]

    def forward_backward(self, req: FwdBwd) -> bytes:
        """The request's loss and, unless forward-only, its gradients added to the client's. Its data run in pieces of
        at most `batch_tokens` padded tokens (micro_batches), the gradients adding up over them: the same sums as one
        pass over the whole request. A non-finite loss in any piece refuses the request and leaves the gradients as
        they were before it."""
        client = self.clients[req.model_id]
        pieces = micro_batches([len(d.tokens) for d in req.data], self.batch_tokens)
        # more than one piece: the gradients so far are set aside, so a later piece's non-finite loss can undo the
        # earlier pieces' backward (one piece is checked before its backward, as a whole request)
        kept = {p: p.grad for p in client.params.values()} if len(pieces) > 1 and not req.forward_only else None
        if kept is not None:
            for p in kept:
                p.grad = None
        outputs, totals = [None] * len(req.data), []
        try:
            with self._client_net(client) as net, torch.set_grad_enabled(not req.forward_only):
                for piece in pieces:
                    data = [req.data[i] for i in piece]
                    logp, loss, lengths = self._piece_loss(net, req, data)
                    total = loss.sum()
                    if not torch.isfinite(total):  # refused before its backward: it would poison the gradients kept
                        raise ApiError(400, f"{req.loss_fn} gave a non-finite loss (check the inputs' logprobs and "
                                            "advantages)", param="loss_fn_inputs")
                    if not req.forward_only and total.requires_grad:
                        total.backward()  # gradients add up over pieces and calls until optim_step
                    totals.append(total.detach())
                    for i, (at, n) in enumerate(zip(piece, lengths)):  # each datum's outputs in its place
                        outputs[at] = {"logprobs": logp[i, :n].detach(), "elementwise_loss": loss[i, :n].detach()}
        except BaseException:
            if kept is not None:
                for p, grad in kept.items():
                    p.grad = grad
            raise
        if kept is not None:
            for p, grad in kept.items():
                if grad is not None:
                    p.grad = grad if p.grad is None else grad.add_(p.grad)
        return encode_forward_backward(outputs, {"loss:sum": torch.stack(totals).sum().item()})

    def _piece_loss(self, net, req: FwdBwd, data: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Log-probs and element-wise losses [rows, longest] of some of a request's data, right-padded (0 past each
        datum's end), and each datum's length. The losses are element-wise, so one call over the padded batch gives
        each datum's own values."""
        logp, lengths = self.logprobs(net, [(d.tokens, d.inputs["target_tokens"]) for d in data])
        inputs = {}
        for name in {k for d in data for k in d.inputs} - {"target_tokens"}:
            value = torch.ones(logp.shape) if name == "weights" else torch.zeros(logp.shape)  # weights: ones if absent
            for i, d in enumerate(data):
                if name in d.inputs:
                    value[i, :lengths[i]] = d.inputs[name]
            inputs[name] = value
        real = torch.arange(logp.shape[1]) < torch.tensor(lengths)[:, None]  # [rows, longest]
        loss = torch.where(real, LOSSES[req.loss_fn][0](logp, inputs, req.config), 0.0)
        return logp, loss, lengths

    def optim_step(self, model_id: str, adam) -> dict:
        client = self.clients[model_id]
        for group in client.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        params = [p for p in client.params.values() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf) \
            if params else torch.tensor(0.0)
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"metrics": {"grad_norm:mean": float(grad_norm), "step:max": float(client.steps)}}

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def folder(self, tinker_path: str, field_name: str = "path") -> str:
        """ROOT/RUN/KIND/NAME for tinker://RUN/KIND/NAME (ApiError naming `field_name` when it is not one)."""
        parts = checkpoint_parts(tinker_path)
        if parts is None:
            raise ApiError(400, f"{field_name} {tinker_path!r} is not tinker://RUN/weights/NAME or "
                                "tinker://RUN/sampler_weights/NAME", param=field_name)
        return os.path.join(self.root, *parts)

    def save(self, model_id: str, name: str, kind: str, overwrite: bool) -> dict:
        """The client's adapter (and, for `weights`, its optimizer) at tinker://MODEL/KIND/NAME."""
        client = self.clients[model_id]
        path = f"tinker://{model_id}/{kind}/{name}"
        folder = self.folder(path)
        if os.path.exists(os.path.join(folder, STATE_FILE)):
            if not overwrite:
                raise ApiError(409, f"{path} exists (save with overwrite=True to replace it)", param="path")
            os.remove(os.path.join(folder, STATE_FILE))  # until the new one is whole, the folder is no checkpoint
        state = {"base_model": self.name, "lora": vars(client.lora), "steps": client.steps}
        if kind == "weights":
            state["optimizer"] = client.optimizer.state_dict()
        os.makedirs(folder, exist_ok=True)
        if client.model is not None:  # full: the weights as a Hugging Face folder, which is also what export reads
            client.model.save_pretrained(os.path.join(folder, FULL_DIR))
            self.tokenizer.save_pretrained(os.path.join(folder, FULL_DIR))
        else:
            state["adapter"] = {n: p.detach().clone() for n, p in client.params.items()}
            self._save_peft(client.adapter, os.path.join(folder, "adapter"))
        torch.save(state, os.path.join(folder, STATE_FILE) + ".tmp")  # last: a state.pt is a complete checkpoint
        os.replace(os.path.join(folder, STATE_FILE) + ".tmp", os.path.join(folder, STATE_FILE))
        return {"path": path, "type": "save_weights" if kind == "weights" else "save_weights_for_sampler"}

    def _save_peft(self, adapter: str, folder: str) -> None:
        """The adapter as peft saves one (adapter_config.json, adapter_model.safetensors) over the served model's
        folder: `PeftModel.from_pretrained(base, folder)` loads it without plait."""
        import copy

        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        config = copy.deepcopy(self.peft.peft_config[adapter])
        config.base_model_name_or_path = os.path.abspath(self.path)
        config.save_pretrained(folder)
        weights = get_peft_model_state_dict(self.peft, adapter_name=adapter)
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, os.path.join(folder, "adapter_model.safetensors"))

    def read(self, path: str, field_name: str = "path") -> dict:
        file = os.path.join(self.folder(path, field_name), STATE_FILE)
        if not os.path.isfile(file):
            raise ApiError(404, f"{field_name} {path!r}: no such checkpoint on this server (under {self.root})",
                           param=field_name)
        return torch.load(file, weights_only=True)

    def full_weights(self, path: str, field_name: str = "path") -> dict[str, torch.Tensor]:
        """The state dict of a full fine-tuning checkpoint's model/ folder (its head too where it is tied)."""
        from plait.models import load_causal_lm
        return load_causal_lm(os.path.join(self.folder(path, field_name), FULL_DIR)).state_dict()

    def load(self, model_id: str, path: str, optimizer: bool) -> dict:
        state = self.read(path)
        client = self.clients[model_id]
        saved = Lora(**state["lora"])
        if (saved.rank, saved.train_mlp, saved.train_attn, saved.train_unembed) != \
                (client.lora.rank, client.lora.train_mlp, client.lora.train_attn, client.lora.train_unembed):
            raise ApiError(400, f"{path} was saved with LoRA {state['lora']}, this client has {vars(client.lora)}",
                           param="path")
        self._copy_into(client.params, self.full_weights(path) if client.model is not None else state["adapter"])
        if optimizer:
            if "optimizer" not in state:
                raise ApiError(400, f"{path} holds no optimizer state (a sampler checkpoint)", param="optimizer")
            client.optimizer.load_state_dict(state["optimizer"])
            client.steps = state.get("steps", client.steps)
        client.optimizer.zero_grad(set_to_none=True)
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    def create_from(self, model_id: str, path: str, optimizer: bool) -> dict:
        state = self.read(path)
        self.create(model_id, Lora(**state["lora"]))
        return self.load(model_id, path, optimizer)

    @staticmethod
    def _copy_into(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])

    # -- samplers -------------------------------------------------------------------------------------------------
    def sampler_from_client(self, sampler_id: str, model_id: str) -> dict:
        client = self.clients[model_id]
        full = client.model is not None
        weights = self._snapshot(client.model.state_dict() if full else client.params, client)
        self.samplers[sampler_id] = Sampler(weights, None, client.lora)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    def sampler_from_path(self, sampler_id: str, path: str | None) -> None:
        if path is None:
            self.samplers[sampler_id] = Sampler(None)
            return
        state = self.read(path, "model_path")
        lora = Lora(**state["lora"])
        weights = self.full_weights(path, "model_path") if lora.rank == 0 else state["adapter"]
        self.samplers[sampler_id] = Sampler(self._snapshot(weights), path, lora)

    def _snapshot(self, weights: dict[str, torch.Tensor], client: Client | None = None) -> str:
        """A frozen copy of a sampler's weights (a LoRA's adapter tensors or full weights); its key. `client`: the
        training client it is made from, which keeps its newest `samplers_kept(client)` (older ones are dropped)."""
        key = f"snapshot{self.adapters}"
        self.adapters += 1
        self.snapshots[key] = {k: v.detach().clone() for k, v in weights.items()}
        if client is not None:
            client.snapshots.append(key)
            for old in client.snapshots[:-samplers_kept(client)]:
                self.snapshots[old] = None
            del client.snapshots[:-samplers_kept(client)]
        return key

    # -- the samplers' engine -----------------------------------------------------------------------------------
    def engine(self, sampler: Sampler, who: str | None = None):
        """The samplers' Rollout worker holding `sampler`'s weights; a load is a `load_weights` span on the timeline
        for `who` (the sampler's id)."""
        from plait.models import config_overlay
        from plait.profiler.timeline import TIMELINE
        from plait.workers.rollout import Rollout
        if self.rollout is None:
            path = self.path
            if self.tied:  # the head gets its own tensor: a LoRA on it must not move the embeddings
                path = config_overlay(self.path, {"tie_word_embeddings": False}, os.path.join(self.root, ".engine-model"))
            with _quiet_load():  # its head is "missing" from the files: loaded from the trainer just below
                self.rollout = Rollout(path, self.max_tokens, self.tokenizer, self.profiler, cfg=self.engine_cfg)
        if self.loaded != sampler.weights:
            with TIMELINE.span("tinker", "load_weights", session=who):
                self._load(sampler)
        return self.rollout

    def _load(self, sampler: Sampler) -> None:
        """The sampler's weights into the engine; a LoRA's merged into the base model (as the actor syncs its rollout
        a LoRA policy) through the slot adapter of its shape, which its tensors are copied into."""
        from plait.models import merged_state_dict
        if sampler.weights is None:
            if self.peft is None:
                weights = {k: v.detach() for k, v in self.base().state_dict().items()}
            else:
                with self.peft.disable_adapter():
                    weights = merged_state_dict(self.peft)
        else:
            weights = self.snapshots[sampler.weights]
            if weights is None:
                full = sampler.lora is not None and sampler.lora.rank == 0
                raise ApiError(400, f"this sampler's weights were dropped: a {'full fine-tuning' if full else 'LoRA'} "
                                    f"client keeps its newest {KEPT_FULL_SNAPSHOTS if full else KEPT_LORA_SNAPSHOTS} "
                                    "samplers (save_weights_for_sampler(name) keeps one on disk)",
                               param="sampling_session_id")
            if sampler.lora.rank > 0:
                lora = sampler.lora
                shape = (lora.rank, lora.train_mlp, lora.train_attn, lora.train_unembed)
                if shape not in self.slots:
                    slot = self._add_adapter(lora)
                    self.slots[shape] = slot, self._params(slot)
                    for p in self.slots[shape][1].values():
                        p.requires_grad_(False)
                slot, params = self.slots[shape]
                self._copy_into(params, weights)
                self.peft.base_model.set_adapter(slot)  # the one merged; a training request sets its own again
                weights = merged_state_dict(self.peft)
        # share: the engine takes these tensors as its own (no copy). None of them is written again: a snapshot is
        # frozen, a merged weight is new, the rest are the frozen base's. Every load shares, so the engine never
        # copies into a tensor it took from an earlier one.
        self.rollout.load_weights(weights, self.rollout.version + 1, share=True)
        self.loaded = sampler.weights

    def close(self) -> None:
        """Stop the samplers' engine (its own processes, if it has any)."""
        if self.rollout is not None:
            self.rollout.close()

    def sample(self, sampler_id: str, prompt: list[int], num_samples: int, params: SampleParams,
               with_prompt_logprobs: bool) -> bytes:
        """`num_samples` continuations of `prompt` from the engine, each token's log-prob under the model itself
        (temperature 1: what `compute_logprobs` and `forward` give for the same tokens)."""
        return self.sample_many(sampler_id, params, [(prompt, num_samples, with_prompt_logprobs)])[0]

    def sample_many(self, sampler_id: str, params: SampleParams, asks: list[tuple[list[int], int, bool]]) -> list[bytes]:
        """Several sample requests of one sampler with the same params as one engine call (the SDK sends a batch's
        prompts as concurrent requests; one at a time they cost the engine's batching); each (prompt, num_samples,
        with_prompt_logprobs) gets its own answer. A seeded request is sampled alone (routes.py)."""
        rollout = self.engine(self.samplers[sampler_id], sampler_id)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, -1),
                    "do_sample": params.temperature > 0}
        gen = rollout._round(seed)([p for p, n, _ in asks for _ in range(n)], params.max_tokens, sampling)
        own = params.temperature == 0 or (params.temperature == 1 and params.top_p == 1 and params.top_k <= 0)
        answers, first = [], 0
        for prompt, num_samples, with_prompt_logprobs in asks:
            out = []
            for row in range(first, first + num_samples):
                n = int(gen.response_mask[row].sum())
                tokens, reason = self._stopped(gen.responses[row, :n].tolist(), params)
                reason = "stop" if reason or gen.stop_reasons[row] == "eos" else "length"
                logprobs = gen.logprobs[row, :len(tokens)].tolist() if own else \
                    self._score(rollout, prompt + tokens)[len(prompt) - 1:]
                out.append((tokens, logprobs, reason))
            first += num_samples
            prompt_logprobs = [math.nan] + self._score(rollout, prompt) if with_prompt_logprobs else None
            answers.append(encode_sample(out, prompt_logprobs))
        return answers

    def _stopped(self, tokens: list[int], params: SampleParams) -> tuple[list[int], bool]:
        """`tokens` up to and including the first stop token or the token that completes a stop string; whether
        one was met."""
        for i, token in enumerate(tokens):
            if token in params.stop_ids or (params.stop_strings and any(
                    s in self.tokenizer.decode(tokens[:i + 1]) for s in params.stop_strings)):
                return tokens[:i + 1], True
        return tokens, False

    @staticmethod
    def _score(rollout, ids: list[int]) -> list[float]:
        """The log-prob of each token of `ids` after its prefix under the engine's weights (temperature 1)."""
        if len(ids) < 2:
            return []
        scored = rollout.probe_logprobs(ids)
        if scored is None:
            raise ApiError(400, f"the {rollout.engine_name} engine cannot score given tokens: sample at temperature 1 "
                                "without top_k / top_p, and without prompt log-probs", param="sampling_params")
        return scored


def samplers_kept(client: Client) -> int:
    """How many of its newest samplers a training client keeps: each is a copy of its model, or of its adapter."""
    return KEPT_FULL_SNAPSHOTS if client.model is not None else KEPT_LORA_SNAPSHOTS


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Runs of the data taken shortest first (in their order where equally long) whose padded size (rows x the
    longest) stays within `budget` tokens; a datum longer than the budget is a run of its own. Shortest first: a
    piece's rows are about equally long, so little of it is padding (an RL batch's responses vary in length)."""
    pieces, longest = [[]], 0
    for i, n in sorted(enumerate(lengths), key=lambda item: item[1]):
        if pieces[-1] and (len(pieces[-1]) + 1) * max(longest, n) > budget:
            pieces.append([])
            longest = 0
        pieces[-1].append(i)
        longest = max(longest, n)
    return pieces


def checkpoint_parts(tinker_path: str) -> list[str] | None:
    """[RUN, KIND, NAME] of tinker://RUN/KIND/NAME (KIND weights or sampler_weights); None: not such a path."""
    parts = tinker_path.removeprefix("tinker://").split("/")
    if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") \
            or any(p in ("", ".", "..") for p in parts):
        return None
    return parts


@contextlib.contextmanager
def _quiet_load():
    """transformers' load report for a model whose untied head is not in its files (filled right after)."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
