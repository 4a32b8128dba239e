"""The trained policy out of a checkpoint: a Hugging Face folder that transformers and vLLM load.

`plait export CHECKPOINT OUT` (and `actor.checkpoint.save_contents` with `hf_model`, which writes the
same folder into the checkpoint as `actor/huggingface/`, as verl does) turns an actor checkpoint
into config.json, model.safetensors, generation_config.json and the tokenizer. The weights come from
whichever form the actor saved:

    actor/model.pt        whole state dict (one process)        -> loaded as tensors (weights_only)
    actor/sharded/        FSDP2 shards (torch DCP), any ranks  -> index vetted, shards gathered here
    actor/lora_adapter/   peft adapter over the base model      -> merged into the base, or kept as an
                                                                   adapter folder (lora="adapter")

A Tinker checkpoint of `plait serve` (`tinker://RUN/weights/NAME` or `tinker://RUN/sampler_weights/NAME`, found
under the Tinker dir, or its folder given as a path) exports the same two ways from its `adapter/` (the peft adapter
over the served model, which its adapter_config names), or, for a full fine-tuning client's (LoRA rank 0), from its
`model/` Hugging Face folder; its `state.pt` (the optimizer) is not read. A LoRA on an
output head tied to the embeddings is merged into the head alone (the export unties them), as the adapter computes.

Every file is read as data (plait/safeload.py): nothing in a checkpoint runs. The checkpoint's
manifest is verified first, so a torn or edited save is refused in one line.
Left out: the critic (a value model is not a policy to serve) and quantised or sharded outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import torch

from plait.configtree import ConfigError
from plait.safeload import first_line

HF_DIR = "huggingface"     # inside an actor checkpoint: config, generation config, tokenizer (+ weights with hf_model)
LORA_MODES = ("merge", "adapter")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message is one line naming the file."""


def actor_dir(checkpoint: str) -> str:
    """The actor folder of `checkpoint`: a global_step_N folder, its actor/ folder, a checkpoints/ folder (its
    newest step), or a run's output folder (its checkpoints/' newest step)."""
    path = os.path.normpath(checkpoint)
    if not os.path.isdir(path):
        raise ExportError(f"{checkpoint}: no such directory (give a checkpoints/global_step_N folder)")
    if os.path.isdir(os.path.join(path, "checkpoints")) and not os.path.isdir(os.path.join(path, "actor")):
        path = os.path.join(path, "checkpoints")  # a run's output folder
    if os.path.basename(path) == "checkpoints":
        steps = sorted(int(n.removeprefix("global_step_")) for n in os.listdir(path)
                       if n.startswith("global_step_") and n.removeprefix("global_step_").isdigit())
        if not steps:
            raise ExportError(f"{checkpoint}: holds no global_step_N checkpoint")
        path = os.path.join(path, f"global_step_{steps[-1]}")
    if os.path.isdir(os.path.join(path, "actor")):
        path = os.path.join(path, "actor")
    if not os.path.isfile(os.path.join(path, "optim.pt")):
        raise ExportError(f"{checkpoint}: not a plait actor checkpoint (no actor/optim.pt); "
                          "give a checkpoints/global_step_N folder")
    return path


def export_checkpoint(checkpoint: str, out: str, lora: str = "merge", base: str | None = None,
                      tinker_dir: str | None = None) -> str:
    """Write the policy of `checkpoint` as a Hugging Face folder at `out`; returns `out`.
    `lora`: "merge" (base + adapter, one plain model) or "adapter" (the peft adapter folder);
    `base`: the base model folder when the checkpoint's own record of it has moved; `tinker_dir`: where
    `tinker://` checkpoints are (plait serve's --tinker-dir).

    Only a checkpoint whose manifest verifies is exported, and none that holds a symbolic link (its files
    are its own: nothing outside it is read into the export). The folder is written beside `out` under a
    temporary name and renamed when whole, so a full disk or a crash never leaves a half-written `out`."""
    from plait.trainers.checkpoint import MANIFEST, verify_checkpoint
    if lora not in LORA_MODES:
        raise ExportError(f"--lora {lora}: choose one of {', '.join(LORA_MODES)}")
    tinker = tinker_folder(checkpoint, tinker_dir)
    if tinker is not None:
        step_dir, problem = tinker, linked_out(tinker)
        write = lambda folder: write_tinker_export(tinker, folder, lora, base)  # noqa: E731
    else:
        actor = actor_dir(checkpoint)
        step_dir = os.path.dirname(actor)
        if not os.path.isfile(os.path.join(step_dir, MANIFEST)):
            raise ExportError(f"{step_dir}: no {MANIFEST}: its save did not finish (plait writes the manifest last); "
                              "not exported")
        problem = verify_checkpoint(step_dir) or linked_out(step_dir)
        write = lambda folder: write_export(actor, folder, lora, base)  # noqa: E731
    if problem:
        raise ExportError(f"{step_dir}: {problem}; not exported")
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.path.islink(out)):
        raise ExportError(f"{out} exists and is not a folder (a file or a symbolic link); give a new folder")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
    except OSError as err:
        raise ExportError(f"{out}: cannot write there ({err.strerror}); nothing was written") from None
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private; the export is an ordinary folder
        os.replace(tmp, out)  # `out`: absent, or an empty folder (the CLI refuses one that holds files)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, ExportError) or not isinstance(err, Exception):
            raise
        if isinstance(err, OSError) and err.strerror:
            raise ExportError(f"{out}: not written ({err.strerror}); nothing was left") from None
        raise ExportError(f"{step_dir}: its model does not load ({type(err).__name__}: {first_line(err)}); "
                          "not exported") from None
    return out


def write_export(actor: str, out: str, lora: str = "merge", base: str | None = None) -> None:
    """The export's files into the folder `out` (which exists): the weights, then the tokenizer and
    generation config (save_contents hf_model writes into actor/huggingface/ itself, which holds them)."""
    hf = os.path.join(actor, HF_DIR)
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise ExportError(f"{actor}: no {HF_DIR}/config.json (a checkpoint from before plait saved its model "
                          "config); resume it for one step with a newer plait to write one")
    lora_dir = os.path.join(actor, "lora_adapter")
    if os.path.isdir(lora_dir):
        check_adapter(lora_dir)
    if os.path.isdir(lora_dir) and lora == "adapter":
        copy_adapter(lora_dir, out, base)
    else:
        model = merged_lora_model(lora_dir, base) if os.path.isdir(lora_dir) else whole_model(actor, hf)
        model.save_pretrained(out)  # safetensors
    if os.path.abspath(hf) != os.path.abspath(out):
        copy_tokenizer_and_generation(hf, out)


def tinker_folder(checkpoint: str, tinker_dir: str | None) -> str | None:
    """The folder of a Tinker checkpoint: `tinker://RUN/KIND/NAME` under `tinker_dir`, or a folder holding
    plait serve's state.pt and adapter/; None: not a Tinker checkpoint."""
    from plait.serving.tinker.trainer import FULL_DIR, STATE_FILE, checkpoint_parts
    if checkpoint.startswith("tinker://"):
        parts = checkpoint_parts(checkpoint)
        if parts is None:
            raise ExportError(f"{checkpoint}: not tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
        if tinker_dir is None:
            raise ExportError(f"{checkpoint}: give --tinker-dir, the folder plait serve keeps tinker:// checkpoints in")
        folder = os.path.join(tinker_dir, *parts)
        if not any(os.path.isdir(os.path.join(folder, d)) for d in ("adapter", FULL_DIR)):
            raise ExportError(f"{checkpoint}: no such checkpoint under {tinker_dir} (--tinker-dir: where plait serve "
                              "keeps them)")
        return folder
    found = os.path.isfile(os.path.join(checkpoint, STATE_FILE)) and \
        any(os.path.isdir(os.path.join(checkpoint, d)) for d in ("adapter", FULL_DIR))
    return checkpoint if found else None


def write_tinker_export(folder: str, out: str, lora: str, base: str | None) -> None:
    """A Tinker checkpoint's adapter merged into its base model, or as the peft adapter, with the base's tokenizer
    and generation config; a full fine-tuning one's model/ folder (loaded, so a broken one is refused)."""
    from plait.models import load_causal_lm
    from plait.serving.tinker.trainer import FULL_DIR
    full = os.path.join(folder, FULL_DIR)
    if os.path.isdir(full):
        if lora == "adapter":
            raise ExportError(f"{folder}: a full fine-tuning checkpoint (LoRA rank 0) holds no adapter; export it "
                              "without --lora adapter")
        load_causal_lm(full).save_pretrained(out)
        copy_tokenizer_and_generation(full, out)
        return
    adapter = os.path.join(folder, "adapter")
    check_adapter(adapter)
    if lora == "adapter":
        copy_adapter(adapter, out, base)
    else:
        merged_lora_model(adapter, base).save_pretrained(out)
    copy_tokenizer_and_generation(adapter_base(adapter, base), out)


def linked_out(folder: str) -> str | None:
    """The first symbolic link under `folder` (a checkpoint plait wrote has none), or None."""
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                rel = os.path.relpath(os.path.join(root, name), folder)
                return f"{rel} is a symbolic link (to {os.readlink(os.path.join(root, name))}); plait reads a checkpoint's own files only"
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def whole_model(actor: str, hf: str):
    """The actor's model built from its saved config and filled from model.pt or the DCP shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from plait.models_vl import VL_CLASSES
    config = AutoConfig.from_pretrained(hf, local_files_only=True)

    def build():
        if config.model_type in VL_CLASSES:  # Qwen2-VL / Qwen2.5-VL: no AutoModelForCausalLM class
            return VL_CLASSES[config.model_type]._from_config(config, dtype=config.dtype or torch.float32)
        return AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)
    with torch.device("meta"):  # its size first: a config.json edited to a huge model must not allocate it
        need = sum(t.numel() * t.element_size() for t in build().state_dict().values())
    weights = os.path.join(actor, "sharded") if os.path.isdir(os.path.join(actor, "sharded")) else os.path.join(actor, "model.pt")
    have = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(weights) for f in fs) \
        if os.path.isdir(weights) else os.path.getsize(weights)
    if need > 2 * have + 2**20:
        raise ExportError(f"{hf}/config.json describes a model of {need / 2**20:.0f} MiB and the checkpoint's "
                          f"weights hold {have / 2**20:.0f} MiB: they do not belong together; not exported")
    model = build()
    state = model.state_dict()
    if os.path.isdir(os.path.join(actor, "sharded")):
        load_dcp_model(os.path.join(actor, "sharded"), state)
    else:
        from plait.safeload import UnsafeFileError, load_tensors
        try:
            saved = load_tensors(os.path.join(actor, "model.pt"), map_location="cpu")
        except UnsafeFileError as err:
            raise ExportError(str(err)) from None
        missing, unexpected = set(state) - set(saved), set(saved) - set(state)
        if missing or unexpected:
            raise ExportError(f"{actor}/model.pt does not fit {hf}/config.json (missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]})")
        state = saved
    model.load_state_dict(state)
    return model.eval()


def load_dcp_model(path: str, state: dict[str, torch.Tensor]) -> None:
    """Fill `state` (whole tensors) in place from the "model" part of a torch DCP folder written at any
    world size: the index is vetted before torch unpickles it, the shards are read as tensors."""
    import torch.distributed.checkpoint as dcp
    from plait.safeload import UnsafeFileError, check_dcp_metadata
    try:
        check_dcp_metadata(path)
    except UnsafeFileError as err:
        raise ExportError(str(err)) from None
    try:  # one process, no process group: DCP reads every shard into the whole tensors
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises CheckpointException with per-rank tracebacks
        raise ExportError(f"{path}: the shards do not load into the model's config ({type(err).__name__}: "
                          f"{str(err).strip().splitlines()[0][:200]})") from None


def adapter_base(lora_dir: str, base: str | None) -> str:
    """The base model folder an adapter was trained on: `base`, else the one its adapter_config records."""
    from plait.models import check_model_dir
    with open(os.path.join(lora_dir, "adapter_config.json")) as f:
        recorded = json.load(f).get("base_model_name_or_path")
    path = base or recorded
    try:
        check_model_dir("--base", path, tokenizer=False)
    except ConfigError as err:
        raise ExportError(f"the LoRA adapter's base model: {err}; pass --base MODEL_DIR") from None
    return path


def merged_lora_model(lora_dir: str, base: str | None):
    """Base + adapter merged into one plain model (peft's merge_and_unload). An adapter on an output head tied to
    the embeddings (a Tinker client's train_unembed) is merged into the head alone: the head is untied first."""
    from peft import PeftModel
    from plait.models import load_causal_lm, peft_quiet
    model = load_causal_lm(adapter_base(lora_dir, base))
    with open(os.path.join(lora_dir, "adapter_config.json")) as f:
        targets = json.load(f).get("target_modules") or []
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if head is not None and head.weight is model.get_input_embeddings().weight and any(
            t == head_name or head_name.endswith(f".{t}") or t == head_name.split(".")[-1] for t in targets):
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    with peft_quiet():
        model = PeftModel.from_pretrained(model, lora_dir)
    return model.merge_and_unload().eval()


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")  # what peft's save_pretrained writes


def check_adapter(lora_dir: str) -> None:
    """The adapter folder holds what plait wrote: its weights as safetensors, no pickle (.bin) beside them."""
    others = sorted(set(os.listdir(lora_dir)) - set(ADAPTER_FILES))
    if others or not os.path.isfile(os.path.join(lora_dir, "adapter_model.safetensors")):
        raise ExportError(f"{lora_dir}: holds {', '.join(others) or 'no adapter_model.safetensors'}; plait saves an "
                          f"adapter as {', '.join(ADAPTER_FILES[:2])} only (a .bin is a pickle it never loads)")


def copy_adapter(lora_dir: str, out: str, base: str | None) -> None:
    """The adapter folder as peft saves it, its base_model_name_or_path the absolute base folder."""
    path = os.path.abspath(adapter_base(lora_dir, base))
    for name in os.listdir(lora_dir):
        shutil.copy2(os.path.join(lora_dir, name), os.path.join(out, name))
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = path
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def copy_tokenizer_and_generation(hf: str, out: str) -> None:
    """Everything of the saved huggingface/ folder but the config and weights (written from the model)."""
    for name in os.listdir(hf):
        if name != "config.json" and not name.endswith((".safetensors", ".bin")) and name != "model.safetensors.index.json":
            shutil.copy2(os.path.join(hf, name), os.path.join(out, name))
