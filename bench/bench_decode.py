"""Decode throughput: plait's TransformersEngine against HF `model.generate`, on CPU with 1 thread.

Tiny Qwen2 models built from configs (s, m; vocab 128), prompts of 16 random tokens, sampled
responses (temperature 1, no top-k/top-p). Fixed length (EOS off): batch 16 and 64 x response 32
and 64. Long-tailed (EOS on): batch 64, up to 128 tokens, rows ending at any of 4 ids, counting
real tokens only. Each config alternates HF and plait calls, a warm-up then --runs timed calls
each, and reports the median new tokens/s by wall clock and by process CPU time (the CPU figure
is the steadier one when other processes share the cores). A second part times one decode step:
plait's forward, HF's forward with a DynamicCache, and the sampling; and splits the op time of
plait's forward into matmuls, attention, KV-cache writes and everything else (torch.profiler).
Each config also gives plait's tokens/s as a share of the FLOP bound (plait/workers/flops.py: the
machine's measured matmul peak over the model's FLOPs per token) and its load-average record
(bench/machine.py; a busy run marks the result `valid: false`).

    python bench/bench_decode.py [--runs 5] [--out bench/results/decode.json]

`--vllm` (in the vLLM environment, docs/rollout.md) adds vLLM's engine beside plait's engine and HF
generate at 1 and 2 threads: batch 16 x 128 new tokens, EOS off, on the s and m models or on
`--model DIR` (e.g. SmolLM2-135M-Instruct from plait.models.smollm2_dir). vLLM runs in its own
engine-core process, its OpenMP threads bound by VLLM_CPU_OMP_THREADS_BIND; plait and HF run
with torch.set_num_threads. `--vllm-only` skips the other sections; `--vllm-batch` and
`--vllm-tokens` shrink the section to rehearse it.

    python bench/bench_decode.py --vllm [--vllm-only] [--model DIR] [--out bench/results/decode_vllm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from machine import capability, measured, verdict
from plait.workers.flops import ModelFlops, device_peak_flops
from plait.workers.rollout_engine import (SamplingParams, TransformersEngine, _HFStepper, _LlamaStepper,
                                          sample_tokens)

SIZES = {
    "s": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256),
    "m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=512),
}
VOCAB, PROMPT_LEN, BATCHES, RESPONSES = 128, 16, (16, 64), (32, 64)
OP_GROUPS = {"matmul": ["aten::mm", "aten::addmm"], "attention": ["aten::_scaled_dot_product_flash_attention_for_cpu"],
             "cache_write": ["aten::copy_"]}
EOS_IDS = [5, 6, 7, 8]  # ~3% a step on these near-uniform models: long-tailed lengths, as in RL


def build(size: str) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES[size])
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def timed(fn) -> tuple[float, float, int]:
    """Wall seconds, process CPU seconds, and the new tokens fn() says it generated."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def throughput(model, batch: int, new: int, runs: int, eos: list[int]) -> dict:
    """Median new tokens/s of HF generate and of plait, alternating calls. With `eos`, rows end at
    those ids (HF keeps finished rows in the batch; plait drops them) and only real tokens count."""
    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=eos)
    params = SamplingParams(max_new_tokens=new)
    gen = torch.Generator().manual_seed(0)
    eos_t = torch.tensor(eos, dtype=torch.long)

    def hf():
        ids = prompts.to(model.device)  # the model may be on a GPU (bench/gpu_check.py)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=0 if eos else new, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             pad_token_id=0, eos_token_id=eos or None, use_cache=True)[:, PROMPT_LEN:].cpu()
        is_eos = torch.isin(out, eos_t)
        return int(((is_eos.cumsum(1) - is_eos.long()) == 0).sum())  # up to and including the first EOS

    def plait():
        return int(engine.generate(prompts.tolist(), params, gen).response_mask.sum())

    runs_of = {"hf": [], "plait": []}
    for i in range(runs + 1):  # run 0 is the warm-up
        for name, fn in (("hf", hf), ("plait", plait)):
            wall, cpu, tokens = timed(fn)
            if i:
                runs_of[name].append((tokens / wall, tokens / cpu, tokens / batch))
    row = {}
    for name, rs in runs_of.items():
        row[f"{name}_tok_s"] = round(statistics.median(r[0] for r in rs))
        row[f"{name}_cpu_tok_s"] = round(statistics.median(r[1] for r in rs))
        if eos:
            row[f"{name}_mean_len"] = round(statistics.mean(r[2] for r in rs), 1)
    row["ratio"] = round(row["plait_tok_s"] / row["hf_tok_s"], 2)
    row["ratio_cpu"] = round(row["plait_cpu_tok_s"] / row["hf_cpu_tok_s"], 2)
    return row


def step_breakdown(model, batch: int, steps: int = 32, reps: int = 5) -> dict:
    """CPU ms per decode step: plait's decode forward, HF's forward with a DynamicCache, sampling."""
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    real, pos = torch.ones_like(ids), torch.arange(PROMPT_LEN).expand(batch, -1)
    params, gen = SamplingParams(max_new_tokens=steps), torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB)

    def forward(stepper_cls):
        stepper = stepper_cls(model, real, PROMPT_LEN + steps)
        stepper.prefill(ids, pos)
        return lambda s: stepper.decode(ids[:, -1], torch.full((batch,), PROMPT_LEN + s))

    parts = {"plait_forward": lambda: forward(_LlamaStepper), "hf_forward": lambda: forward(_HFStepper),
             "sampling": lambda: (lambda s: sample_tokens(logits, params, gen))}
    out = {}
    with torch.inference_mode():
        for name, setup in parts.items():
            cpu = []
            for _ in range(reps):
                step = setup()
                t = time.process_time()
                for s in range(steps - 1):
                    step(s)
                cpu.append((time.process_time() - t) / (steps - 1) * 1e3)
            out[f"{name}_ms"] = round(min(cpu), 3)
        # share of op time in plait's decode step, from torch.profiler (which inflates small ops)
        step = parts["plait_forward"]()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for s in range(steps - 1):
                step(s)
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    for part, names in OP_GROUPS.items():
        out[f"share_{part}"] = round(sum(ops.get(n, 0) for n in names) / total, 3)
    out["share_other_ops"] = round(1 - sum(out[f"share_{part}"] for part in OP_GROUPS), 3)
    return out


def vllm_rows(models: dict[str, str], runs: int, batch: int = 16, new: int = 128) -> list[dict]:
    """Median new tokens/s of vLLM, plait's engine and HF generate, fixed length, at 1 and 2 threads."""
    from transformers import AutoModelForCausalLM
    from plait.config import RolloutConfig
    from plait.workers.vllm_engine import VLLMEngine
    rows = []
    for name, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = torch.randint(3, model.config.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
        params = SamplingParams(max_new_tokens=new)
        for threads in sorted({1, min(2, os.cpu_count() or 1)}):
            torch.set_num_threads(threads)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
            vllm = VLLMEngine(path, RolloutConfig(name="vllm", dtype="float32"), torch.float32, "cpu", [], ignore_eos=True)
            plait_engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=[])
            gen = torch.Generator().manual_seed(0)
            calls = {
                "vllm": lambda: int(vllm.generate(prompts.tolist(), params, gen).response_mask.sum()),
                "plait": lambda: int(plait_engine.generate(prompts.tolist(), params, gen).response_mask.sum()),
                "hf": lambda: int(model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                                 min_new_tokens=new, do_sample=True, top_k=0, pad_token_id=0).shape[1]
                                  - PROMPT_LEN) * batch}

            def timed_all() -> dict:
                out = {}
                for label, fn in calls.items():
                    fn()  # warm-up
                    out[f"{label}_tok_s"] = round(statistics.median(t / w for w, _, t in (timed(fn) for _ in range(runs))))
                return out
            row, load = measured(timed_all, threads=threads)
            vllm.close()
            rows.append({"model": name, "threads": threads, "batch": batch, "response_len": new, **row, "load": load})
            print(f"  vllm {name} {threads} thread(s): vLLM {row['vllm_tok_s']} tok/s, plait {row['plait_tok_s']}, "
                  f"HF {row['hf_tok_s']}", flush=True)
    torch.set_num_threads(1)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None, help="default: bench/results/decode.json (decode_vllm.json with --vllm)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM's engine (the vLLM environment)")
    ap.add_argument("--vllm-only", action="store_true", help="with --vllm: only that section")
    ap.add_argument("--model", default=None, help="with --vllm: a model folder instead of the s and m models")
    ap.add_argument("--vllm-batch", type=int, default=16, help="with --vllm: rows per generate call")
    ap.add_argument("--vllm-tokens", type=int, default=128, help="with --vllm: new tokens per row")
    args = ap.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / ("decode_vllm.json" if args.vllm else "decode.json"))
    torch.set_num_threads(1)
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(),
                    **capability()},
        "dtype": "float32",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "runs": args.runs, "prompt_len": PROMPT_LEN, "vocab": VOCAB,
        "configs": [], "step_breakdown": [],
    }
    if args.vllm:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            models = {"model": args.model} if args.model else {}
            for size in ([] if args.model else SIZES):
                models[size] = os.path.join(tmp, size)
                build(size).save_pretrained(models[size])
            result["vllm"] = vllm_rows(models, args.runs, batch=args.vllm_batch, new=args.vllm_tokens)
    print(f"{'size':>4} {'batch':>5} {'resp':>4} {'eos':>4} | {'HF tok/s':>9} {'plait tok/s':>11} {'ratio':>5} | "
          f"{'CPU-time ratio':>14}")
    for size in ([] if args.vllm_only else SIZES):
        model = build(size)
        flops = ModelFlops.of(model)
        configs = [(b, n, []) for b in BATCHES for n in RESPONSES] + [(64, 128, EOS_IDS)]
        for batch, new, eos in configs:
            measures, load = measured(throughput, model, batch, new, args.runs, eos)
            row = {"size": size, "batch": batch, "response_len": new, "eos": eos, **measures, "load": load}
            # tokens/s if every decode step ran at the measured matmul peak (prompt + response context)
            row["flop_bound_tok_s"] = round(flops.peak / (flops.forward([PROMPT_LEN + new]) / (PROMPT_LEN + new)))
            row["share_of_flop_bound"] = round(row["plait_tok_s"] / row["flop_bound_tok_s"], 3)
            result["configs"].append(row)
            print(f"{size:>4} {batch:>5} {new:>4} {'on' if eos else 'off':>4} | {row['hf_tok_s']:>9} "
                  f"{row['plait_tok_s']:>11} {row['ratio']:>5} | {row['ratio_cpu']:>14} | "
                  f"{row['share_of_flop_bound']:.1%} of the FLOP bound", flush=True)
        for batch in BATCHES:
            result["step_breakdown"].append({"size": size, "batch": batch, **step_breakdown(model, batch)})
    print("\nCPU ms per decode step (response 32), and where plait's forward spends its op time:" if result["step_breakdown"] else "")
    for row in result["step_breakdown"]:
        print(f"  {row['size']} b{row['batch']}: plait forward {row['plait_forward_ms']}, "
              f"HF forward {row['hf_forward_ms']}, sampling {row['sampling_ms']} | "
              + ", ".join(f"{k[6:]} {v:.0%}" for k, v in row.items() if k.startswith("share_")))
    result["machine"]["load_avg_end"] = os.getloadavg()
    result["machine"]["matmul_peak_flops"] = device_peak_flops("cpu", torch.float32)
    result.update(verdict([row["load"] for row in result["configs"] + result.get("vllm", [])]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
