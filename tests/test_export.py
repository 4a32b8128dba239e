"""`plait export` and `checkpoint.save_contents=[..., hf_model]`: a checkpoint's policy as a Hugging Face
folder that transformers loads back with the checkpoint's log-probs and greedy answers; FSDP2 shards
gathered to the same folder as their unsharded twin; LoRA merged or kept as an adapter."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait import driver
from plait.cli import main
from plait.trainers.checkpoint import write_manifest
from plait.build import resolve_model
from plait.data.dataset import prompt_batch
from plait.workers.actor import Actor, response_forward
from plait.workers.packing import MicroBatching
from plait.workers.rollout import Rollout

SAVE = ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.val_before_train=false", "trainer.test_freq=-1"]


def trained(tmp_path, tiny_config, *overrides):
    """A 2-step run's lifecycle (its actor holds what global_step_2 saved) and a rollout batch."""
    lifecycle = driver.build(tiny_config(tmp_path, *SAVE, *overrides), progress=False)
    lifecycle.run()
    trainer = lifecycle.trainer
    batch = trainer.roles.rollout.call(Rollout.generate, prompt_batch([trainer.cursor.dataset[i] for i in range(3)]),
                                       trainer.sampling, 0)
    return trainer, batch


def greedy(model, tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0].tolist()


def test_export_loads_in_transformers_with_the_checkpoints_logprobs_and_greedy_answer(tmp_path, tiny_config):
    trainer, batch = trained(tmp_path, tiny_config, "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    actor: Actor = trainer.roles.actor.worker
    step = tmp_path / "checkpoints" / "global_step_2"
    out = tmp_path / "exported"
    assert main(["export", str(step), str(out)]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    got, _ = response_forward(model, batch, 1.0, MicroBatching(8), with_entropy=False)
    want, _ = actor.compute_log_prob(batch, 8)
    torch.testing.assert_close(got, want)
    prompt = "What is 12 + 7?\n"
    assert greedy(model, tokenizer, prompt) == greedy(actor.model.eval(), tokenizer, prompt)
    # the initial model differs: the export holds the trained weights, not the base
    base = AutoModelForCausalLM.from_pretrained(resolve_model(trainer.cfg), local_files_only=True)
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), model.state_dict().values()))
    # save_contents hf_model wrote the same folder into the checkpoint, under its manifest
    inside = step / "actor" / "huggingface"
    assert load_file(inside / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()
    assert all(torch.equal(v, load_file(out / "model.safetensors")[k]) for k, v in load_file(inside / "model.safetensors").items())
    assert "actor/huggingface/model.safetensors" in json.loads((step / "manifest.json").read_text())["files"]


def test_export_refuses_a_damaged_checkpoint_in_one_line(tmp_path, tiny_config, capsys):
    trained(tmp_path, tiny_config)
    capsys.readouterr()
    step = tmp_path / "checkpoints" / "global_step_2"
    with open(step / "actor" / "model.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    assert main(["export", str(tmp_path / "checkpoints"), str(tmp_path / "out")]) == 2  # checkpoints/: the newest
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pt does not match its checksum" in err[0], err
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2  # a run's output folder: its newest too
    assert "model.pt does not match its checksum" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "not a plait actor checkpoint" in capsys.readouterr().err
    assert main(["export", str(step), str(tmp_path / "checkpoints")]) == 2  # never into a folder that holds files
    assert "exists and is not empty" in capsys.readouterr().err


def test_lora_export_merged_and_as_adapter(tmp_path, tiny_config):
    peft = pytest.importorskip("peft")
    trainer, batch = trained(tmp_path, tiny_config, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                             "actor_rollout_ref.actor.optim.lr=1e-2")
    actor: Actor = trainer.roles.actor.worker
    step = tmp_path / "checkpoints" / "global_step_2"
    want, _ = actor.compute_log_prob(batch, 8)
    assert main(["export", str(step), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    assert not any("lora" in k for k in merged.state_dict())
    got, _ = response_forward(merged, batch, 1.0, MicroBatching(8), with_entropy=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    assert main(["export", str(step), str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and (tmp_path / "adapter" / "tokenizer.json").is_file()
    base_dir = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    got, _ = response_forward(adapted, batch, 1.0, MicroBatching(8), with_entropy=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _shard_and_save(rank: int, model_dir: str, ckpt: str, rdzv: str) -> None:
    import torch.distributed as dist
    from plait.config import FsdpConfig
    from plait.models import load_causal_lm
    from plait.workers.parallel import full_state_dict, save_sharded, shard_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    model = load_causal_lm(model_dir)
    with torch.no_grad():  # weights that are not the saved model's: the shards must be what is exported
        for p in model.parameters():
            p.add_(0.01 * (torch.arange(p.numel()).reshape(p.shape) % 7))
    shard_model(model, model._no_split_modules, FsdpConfig(), "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    save_sharded(os.path.join(ckpt, "sharded", "actor", "sharded"), model, optimizer)
    whole = full_state_dict(model)
    if rank == 0:
        torch.save(whole, os.path.join(ckpt, "whole", "actor", "model.pt"))
    dist.barrier()  # neither rank tears the group down while the other still talks to it
    dist.destroy_process_group()


def test_sharded_checkpoint_exports_equal_to_its_unsharded_twin(tmp_path):
    import shutil
    import torch.multiprocessing as mp
    from plait.models import create_tiny_model
    model_dir = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    ckpt = tmp_path / "ckpt"
    for kind in ("sharded", "whole"):  # an actor checkpoint's layout: optim.pt and huggingface/ beside the weights
        hf = ckpt / kind / "actor" / "huggingface"
        hf.mkdir(parents=True)
        for name in os.listdir(model_dir):
            if not name.endswith(".safetensors"):
                shutil.copy2(os.path.join(model_dir, name), hf / name)
        torch.save({}, ckpt / kind / "actor" / "optim.pt")
    mp.spawn(_shard_and_save, args=(model_dir, str(ckpt), str(tmp_path / "rdzv")), nprocs=2)
    assert (ckpt / "sharded" / "actor" / "sharded" / "__1_0.distcp").is_file()
    for kind in ("sharded", "whole"):
        write_manifest(str(ckpt / kind), 1)  # an export takes a checkpoint whose save finished only
        assert main(["export", str(ckpt / kind), str(tmp_path / f"out_{kind}")]) == 0
    sharded, whole = load_file(tmp_path / "out_sharded" / "model.safetensors"), load_file(tmp_path / "out_whole" / "model.safetensors")
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    assert any(not torch.equal(whole[k], original[k]) for k in whole)


def test_save_contents_without_what_a_resume_needs_still_saves_it(capsys):
    """verl's examples save only hf_model (gmpo); plait's checkpoint is always resumable: it writes
    model, optimizer and extra too, and says so in one line. A name plait does not know is refused."""
    from plait.config import load_config
    from plait.configtree import ConfigError
    cfg = load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"])
    assert cfg.actor_rollout_ref.actor.checkpoint.save_contents == ["model", "optimizer", "extra", "hf_model"]
    assert ("plait: actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']: plait's checkpoints always hold "
            "the model, optimizer and extra (what a resume needs), so they are written too") in capsys.readouterr().err
    with pytest.raises(ConfigError, match="each one of model, optimizer, extra, hf_model"):
        load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]"])
    with pytest.raises(ConfigError, match="each one of model, optimizer, extra, hf_model"):
        load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[weights]"])


# -- hostile checkpoints and output paths: one line, exit 2, nothing half-written, nothing from outside --

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A plain and a LoRA global_step_2, trained once for the module; each test works on a copy."""
    from plait.config import load_config
    from tests.conftest import TINY
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, extra in (("plain", []), ("lora", ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"])):
        cfg = load_config(None, [*TINY, f"trainer.default_local_dir={root / name}", *SAVE, *extra])
        driver.build(cfg, progress=False).run()
        out[name] = root / name / "checkpoints" / "global_step_2"
    return out


def copy_of(checkpoints, tmp_path, name="plain"):
    import shutil
    step = tmp_path / "ckpt" / "global_step_2"
    shutil.copytree(checkpoints[name], step, symlinks=True)
    return step


def export_line(capsys, *args) -> str:  # args: the command line after `plait`
    capsys.readouterr()
    assert main([*map(str, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait: export: ") and "Traceback" not in err[0], err
    return err[0]


def remanifest(step):
    from plait.trainers.checkpoint import MANIFEST, write_manifest
    os.remove(step / MANIFEST)
    write_manifest(str(step), 2)


def test_export_follows_no_link_out_of_the_checkpoint(checkpoints, tmp_path, capsys):
    step = copy_of(checkpoints, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the checkpoint")
    os.symlink(secret, step / "actor" / "huggingface" / "notes.txt")
    remanifest(step)  # even under a manifest that lists it
    line = export_line(capsys, "export", step, tmp_path / "out")
    assert "actor/huggingface/notes.txt is a symbolic link" in line and not (tmp_path / "out").exists()


def test_export_refuses_a_crashed_save_without_a_manifest(checkpoints, tmp_path, capsys):
    step = copy_of(checkpoints, tmp_path)
    os.remove(step / "manifest.json")
    assert "no manifest.json: its save did not finish" in export_line(capsys, "export", step, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["file", "dangling symlink"])
def test_export_into_a_path_that_is_not_a_folder_is_one_line(checkpoints, tmp_path, capsys, kind):
    step = copy_of(checkpoints, tmp_path)
    out = tmp_path / "out"
    out.write_text("mine") if kind == "file" else os.symlink(tmp_path / "nowhere", out)
    assert "exists and is not a folder" in export_line(capsys, "export", step, out)
    assert os.path.islink(out) or out.read_text() == "mine"


def _export_with_file_size_limit(step, out, limit):
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, as a full disk gives ENOSPC
    os._exit(main(["export", str(step), str(out)]))


def test_a_failed_write_leaves_no_half_written_export(checkpoints, tmp_path):
    step = copy_of(checkpoints, tmp_path)
    out = tmp_path / "out"
    pid = os.fork()
    if pid == 0:
        _export_with_file_size_limit(step, out, 4096)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2
    assert os.listdir(tmp_path) == ["ckpt"]  # no out, no temporary folder


def test_export_refuses_a_config_that_does_not_fit_the_weights(checkpoints, tmp_path, capsys):
    step = copy_of(checkpoints, tmp_path)
    config = step / "actor" / "huggingface" / "config.json"
    crafted = json.loads(config.read_text())
    crafted.update(hidden_size=65536, intermediate_size=262144)  # ~GiBs, from a few MiB of weights
    config.write_text(json.dumps(crafted))
    remanifest(step)
    assert "describes a model of" in export_line(capsys, "export", step, tmp_path / "out")
    config.write_text('{"model_type": "no_such_model"}')
    remanifest(step)
    assert "its model does not load" in export_line(capsys, "export", step, tmp_path / "out")


def test_export_refuses_a_tampered_or_pickled_adapter(checkpoints, tmp_path, capsys):
    pytest.importorskip("peft")
    step = copy_of(checkpoints, tmp_path, "lora")
    adapter = step / "actor" / "lora_adapter" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[8:16] = b'{"a":1}x'  # the JSON header, broken
    adapter.write_bytes(bytes(data))
    remanifest(step)
    assert "its model does not load" in export_line(capsys, "export", step, tmp_path / "out")
    marker = tmp_path / "ran"
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    (step / "actor" / "lora_adapter" / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))
    os.remove(adapter)
    remanifest(step)
    for mode in ("merge", "adapter"):
        line = export_line(capsys, "export", step, tmp_path / "out", "--lora", mode)
        assert "a .bin is a pickle it never loads" in line and not marker.exists()
