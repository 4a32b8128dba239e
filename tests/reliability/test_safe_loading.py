"""Loading is data, never code: a crafted pickle in a profile folder or a checkpoint runs nothing;
a checkpoint that fails to load for any reason is skipped like a damaged one; a resume with a
changed meaning-changing key is refused naming it, one line per key."""

import json
import os
import pickle
import shutil

import pytest
import torch

from plait import cli
from plait.safeload import UnsafeFileError, load_pickle, load_tensors
from plait.trainers.checkpoint import write_manifest


class Payload:
    """Unpickling this runs `touch <marker>`: what an attacker plants."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_plain_snapshot_loads_and_a_crafted_one_runs_nothing(tmp_path):
    plain = {"segments": [{"address": 1, "blocks": [{"size": 512, "state": "active_allocated"}]}],
             "device_traces": [[{"action": "alloc", "size": 512, "frames": [{"filename": "a.py", "line": 3}]}]],
             "tags": {1, 2}, "raw": b"\x00"}
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        (tmp_path / "ok.pickle").write_bytes(pickle.dumps(plain, protocol=protocol))
        assert load_pickle(str(tmp_path / "ok.pickle")) == plain
    marker = tmp_path / "ran"
    (tmp_path / "bad.pickle").write_bytes(pickle.dumps({"segments": [Payload(marker)]}))
    with pytest.raises(UnsafeFileError) as err:
        load_pickle(str(tmp_path / "bad.pickle"))
    assert not marker.exists()
    assert str(err.value) == (f"{tmp_path / 'bad.pickle'}: refused to load: it asks for posix.system, and plait "
                              "reads only plain data (dicts, lists, strings, numbers) from pickles; nothing in it ran")


def test_plait_profile_report_on_a_crafted_folder_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "actor_rank0.pickle").write_bytes(pickle.dumps(Payload(marker)))
    record = {"steps": [1, 1], "role": "actor", "stage": None, "rank": 0, "pid": 1, "tool": "torch_memory",
              "path": "step1/actor_rank0.pickle", "start_time": 0.0, "end_time": 1.0, "policy_version": 0,
              "complete": True}
    (tmp_path / "manifest.jsonl").write_text(json.dumps(record) + "\n")
    cli.main(["profile", "report", str(tmp_path)])
    assert not marker.exists()
    page = (tmp_path / "report" / "index.html").read_text()
    assert "refused to load: it asks for posix.system" in page


def test_a_crafted_tensor_file_runs_nothing_and_is_one_line(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"optimizer": Payload(marker)}, tmp_path / "optim.pt")
    with pytest.raises(UnsafeFileError) as err:
        load_tensors(str(tmp_path / "optim.pt"))
    assert not marker.exists()
    message = str(err.value)
    assert "\n" not in message and "weights_only=False" not in message
    assert message.startswith(f"{tmp_path / 'optim.pt'}: does not load as tensors (UnpicklingError: ")


# -- a real run's checkpoints --------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config_module):
    """A tiny sync run with checkpoints of steps 1 and 2 (its output dir; copied by each test)."""
    out = tmp_path_factory.mktemp("run") / "out"
    assert train(tiny_config_module, out, "trainer.total_training_steps=2") == 0
    assert sorted(os.listdir(out / "checkpoints"))[:2] == ["global_step_1", "global_step_2"]
    return out


@pytest.fixture(scope="module")
def tiny_config_module():
    from plait.config import load_config
    from tests.conftest import TINY

    def make(out_dir, *overrides):
        return load_config(None, [*TINY, f"trainer.default_local_dir={out_dir}", "trainer.save_freq=1",
                                  "trainer.test_freq=-1", *overrides])
    return make


def train(make, out, *overrides) -> int:
    import yaml
    from plait.configtree import to_dict
    config = out.parent / "config.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(to_dict(make(out, *overrides))))
    return cli.main(["train", "--no-progress", "--config", str(config)])


def copy_run(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    return out


def plant(step_dir, rel, write):
    """Damage one file so that the manifest still verifies (a crafted, not a torn, checkpoint)."""
    write(step_dir / rel)
    (step_dir / "manifest.json").unlink()
    write_manifest(str(step_dir), int(step_dir.name.removeprefix("global_step_")))


def truncated(path):
    path.write_bytes(path.read_bytes()[:100])


def wrong_shapes(path):
    state = torch.load(path, weights_only=True)
    name = next(iter(state))
    state[name] = torch.zeros(3, 5)
    torch.save(state, path)


def wrong_keys(path):
    state = torch.load(path, weights_only=True)
    state.pop("optimizer")
    torch.save(state, path)


DAMAGE = {
    "malicious optim.pt": ("actor/optim.pt", None, "actor/optim.pt: does not load as tensors (UnpicklingError: "),
    "malicious model.pt": ("actor/model.pt", None, "actor/model.pt: does not load as tensors (UnpicklingError: "),
    "truncated model.pt": ("actor/model.pt", truncated, "actor/model.pt: does not load as tensors ("),
    "wrong shapes": ("actor/model.pt", wrong_shapes, "it does not load (RuntimeError: Error(s) in loading state_dict"),
    "wrong keys": ("actor/optim.pt", wrong_keys, "it does not load (KeyError: 'optimizer')"),
    "unreadable state": ("trainer_state.json", lambda p: p.write_text("{"), "it does not load (JSONDecodeError: "),
    "unreadable config": ("config.json", lambda p: p.write_text("{"), "it does not load (JSONDecodeError: "),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_checkpoint_that_does_not_load_falls_back_to_the_previous_one(trained, tmp_path, tiny_config_module,
                                                                         capsys, case):
    rel, damage, said = DAMAGE[case]
    out = copy_run(trained, tmp_path)
    marker = tmp_path / "ran"
    damage = damage or (lambda p: torch.save({"optimizer": Payload(marker), "x": Payload(marker)}, p))
    plant(out / "checkpoints" / "global_step_2", rel, damage)
    assert train(tiny_config_module, out, "trainer.total_training_steps=3") == 0
    err = capsys.readouterr().err
    assert not marker.exists()
    warning = next(line for line in err.splitlines() if "skipping checkpoint" in line)
    assert warning.startswith(f"plait: warning: skipping checkpoint {out / 'checkpoints' / 'global_step_2'}: {said}")
    assert f"plait: resumed from {out / 'checkpoints' / 'global_step_1'} (next step 2)" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_resume_path_to_a_checkpoint_that_does_not_load_is_one_line_exit_2(trained, tmp_path, tiny_config_module,
                                                                          capsys):
    out = copy_run(trained, tmp_path)
    ckpt = out / "checkpoints" / "global_step_2"
    plant(ckpt, "actor/optim.pt", truncated)
    code = train(tiny_config_module, out, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}")
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"plait: config error: trainer.resume_from_path='{ckpt}': actor/optim.pt: does not "
                              "load as tensors (")
    assert "Traceback" not in "\n".join(err)


def test_none_loading_after_a_partial_load_is_one_line_not_a_fresh_start(trained, tmp_path, tiny_config_module, capsys):
    out = copy_run(trained, tmp_path)
    for step in (1, 2):
        plant(out / "checkpoints" / f"global_step_{step}", "trainer_state.json", lambda p: p.write_text("{"))
    assert train(tiny_config_module, out, "trainer.total_training_steps=3") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"plait: config error: trainer.resume_mode='auto': no checkpoint in {out / 'checkpoints'} loads")


def test_a_resume_with_changed_meaning_is_refused_naming_each_key(trained, tmp_path, tiny_config_module, capsys):
    out = copy_run(trained, tmp_path)
    code = train(tiny_config_module, out, "trainer.total_training_steps=3", "data.train_batch_size=8",
                 "algorithm.adv_estimator=rloo", "trainer.save_freq=2", "trainer.logger=[console]")
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("plait: config error:")]
    assert [e.split("=")[0] for e in errors] == ["plait: config error: data.train_batch_size",
                                                 "plait: config error: algorithm.adv_estimator"]
    assert errors[0].startswith(f"plait: config error: data.train_batch_size=8: the checkpoint "
                                f"{out / 'checkpoints' / 'global_step_2'} was trained with 4; ")
    assert "trainer.resume_allow_config_change=true" in errors[0]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # nothing ran


def test_a_resume_with_only_safe_changes_is_silent_and_the_allow_key_lets_a_change_through(trained, tmp_path,
                                                                                           tiny_config_module, capsys):
    out = copy_run(trained, tmp_path)
    assert train(tiny_config_module, out, "trainer.total_training_steps=3", "trainer.save_freq=3",
                 "trainer.logger=[console]", "global_profiler.save_path=elsewhere") == 0
    err = capsys.readouterr().err
    assert "changed" not in err and "warning" not in err
    assert train(tiny_config_module, out, "trainer.total_training_steps=4", "algorithm.adv_estimator=rloo",
                 "trainer.resume_allow_config_change=true") == 0
    err = capsys.readouterr().err
    assert ("with algorithm.adv_estimator changed from 'grpo' to 'rloo' (trainer.resume_allow_config_change=true)"
            in err)


def test_a_model_dir_with_a_crafted_pytorch_model_bin_runs_nothing_and_is_one_line(tmp_path, tiny_config, capsys):
    from plait.models import create_tiny_model
    model = create_tiny_model(tmp_path / "model", size="xs")
    os.remove(os.path.join(model, "model.safetensors"))
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, os.path.join(model, "pytorch_model.bin"))
    assert train(tiny_config, tmp_path / "out", f"actor_rollout_ref.model.path={model}") == 2
    err = capsys.readouterr().err
    assert not marker.exists() and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"plait: config error: actor_rollout_ref.model.path='{model}': its weights do not load as tensors (")


def test_a_sharded_checkpoints_index_is_vetted_before_torch_unpickles_it(tmp_path):
    """DCP's .metadata is a pickle torch loads unrestricted: a real one passes, a planted payload
    is refused in one line and never runs."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from plait.safeload import UnsafeFileError, check_dcp_metadata
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    real = tmp_path / "real"
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(real))
    check_dcp_metadata(str(real))  # DCP's own classes, torch.Size, dtypes: allowed

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafeFileError) as err:
        check_dcp_metadata(str(bad))
    assert "refused to load" in str(err.value) and "\n" not in str(err.value)
    assert not ran.exists()


def shard_the_actor(make, out, step):
    """Give checkpoint `step` of a local run the actor's sharded (DCP) folder, which its resume then
    reads instead of model.pt: the actor loaded from the checkpoint, saved by plait's save_sharded."""
    from plait import driver
    from plait.workers.parallel import SHARDED_DIR, save_sharded
    ckpt = out / "checkpoints" / f"global_step_{step}"
    lc = driver.build(make(out), progress=False, checked=True)
    try:
        actor = lc.trainer.roles.actor.worker
        actor.load_checkpoint(str(ckpt / "actor"))
        save_sharded(str(ckpt / "actor" / SHARDED_DIR), actor.model, actor.optimizer)
    finally:
        lc.trainer.close()
        lc.shutdown()
    (ckpt / "manifest.json").unlink()
    write_manifest(str(ckpt), step)
    return ckpt / "actor" / SHARDED_DIR


def plant_in_a_byte_item(folder, payload: bytes) -> str:
    """Replace the first byte item (pickled non-tensor state, e.g. an lr) of a DCP folder's shards by
    `payload`, padded to its length so that the index's offsets stay true; the shard file's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the index plait's own save just wrote
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    assert len(payload) <= info.length
    data = bytearray((folder / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = payload.ljust(info.length, b".")  # pickle stops at its STOP
    (folder / info.relative_path).write_bytes(bytes(data))
    return info.relative_path


def test_a_crafted_byte_item_in_a_sharded_checkpoint_runs_nothing_on_resume(trained, tmp_path, tiny_config_module,
                                                                          capsys):
    """DCP's default planner unpickles a shard's byte items unrestricted: a real sharded checkpoint
    resumes through plait's loader, and one whose byte item became a payload pickle (the manifest
    rewritten to match, as an attacker would) is refused in one line, the payload never run."""
    out = copy_run(trained, tmp_path)
    sharded = shard_the_actor(tiny_config_module, out, 2)
    shutil.copytree(out, tmp_path / "clean")
    assert train(tiny_config_module, tmp_path / "clean", "trainer.total_training_steps=3") == 0
    assert f"plait: resumed from {tmp_path / 'clean' / 'checkpoints' / 'global_step_2'}" in capsys.readouterr().err

    marker = tmp_path / "ran"
    shard = plant_in_a_byte_item(sharded, pickle.dumps(Payload(marker)))
    ckpt = sharded.parent.parent
    (ckpt / "manifest.json").unlink()
    write_manifest(str(ckpt), 2)
    code = train(tiny_config_module, out, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}")
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists() and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"plait: config error: trainer.resume_from_path='{ckpt}': actor/sharded/{shard} (item optim.")
    assert "does not load as tensors (UnpicklingError: " in err.strip().splitlines()[-1]


def test_a_sharded_index_naming_shards_outside_its_folder_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from plait.safeload import check_dcp_metadata
    folder = tmp_path / "sharded"
    dcp.save({"model": torch.nn.Linear(3, 2).state_dict()}, checkpoint_id=str(folder))
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeFileError) as err:
        check_dcp_metadata(str(folder))
    assert str(err.value) == (f"{folder / '.metadata'}: refused to load: it names shard files outside its folder "
                              "('../../elsewhere.distcp'); nothing was read")


@pytest.mark.parametrize("files, said", [
    ({"../../outside.pt": {"size": 1, "crc32": 0}}, "the manifest names a file outside the checkpoint ('../../outside.pt')"),
    ({"/etc/hostname": {"size": 1, "crc32": 0}}, "the manifest names a file outside the checkpoint ('/etc/hostname')"),
    (["model.pt"], "manifest.json is not one plait wrote (each file needs its size and crc32)"),
    ({"model.pt": {"size": "1"}}, "manifest.json is not one plait wrote (each file needs its size and crc32)"),
])
def test_a_crafted_manifest_names_only_the_checkpoints_files(tmp_path, files, said):
    from plait.trainers.checkpoint import verify_checkpoint
    (tmp_path / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))
    assert verify_checkpoint(str(tmp_path)) == said
    (tmp_path / "manifest.json").write_text("[1, 2]")
    assert verify_checkpoint(str(tmp_path)).startswith("no readable manifest.json (TypeError)")


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint(trained, tmp_path, tiny_config_module, capsys):
    """DCP wraps a rank's load failure in a CheckpointException, a BaseException that escaped the
    resume's fallback as a traceback; now the shard's own error is the reason the checkpoint is skipped."""
    out = copy_run(trained, tmp_path)
    sharded = shard_the_actor(tiny_config_module, out, 2)
    shard = next(p for p in sharded.iterdir() if p.suffix == ".distcp")
    plant(sharded.parent.parent, f"actor/sharded/{shard.name}", truncated)
    assert train(tiny_config_module, out, "trainer.total_training_steps=3") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "CheckpointException" not in err
    assert f"plait: warning: skipping checkpoint {out / 'checkpoints' / 'global_step_2'}: it does not load (" in err
    assert f"plait: resumed from {out / 'checkpoints' / 'global_step_1'} (next step 2)" in err


def test_a_rank_local_dcp_index_is_vetted_too(tmp_path):
    """torch falls back to `__<rank>.metadata` (unpickled unrestricted) when .metadata does not load."""
    import torch.distributed.checkpoint as dcp

    from plait.safeload import check_dcp_metadata
    folder = tmp_path / "sharded"
    dcp.save({"model": torch.nn.Linear(3, 2).state_dict()}, checkpoint_id=str(folder))
    marker = tmp_path / "ran"
    (folder / "__0.metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeFileError) as err:
        check_dcp_metadata(str(folder))
    assert str(err.value).startswith(f"{folder / '__0.metadata'}: refused to load: it asks for posix.system")
    assert not marker.exists()
