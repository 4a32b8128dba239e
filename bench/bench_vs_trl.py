"""plait vs TRL's GRPOTrainer: generated tokens per second of GRPO training, side by side on CPU.

Both frameworks train the same saved model: plait's tiny Qwen2s (plait.models.create_tiny_model,
sizes s and m) or a ~46M-parameter Llama (size l, bench/llama_model.py), each
with the same char tokenizer, on the same built-in arithmetic prompts (rendered with the same chat
template: TRL gets plait's rendered prompt text in its prompt-only format), the same reward
(plait's default_compute_score wrapped into TRL's signature), the same prompts x n per step, the
same fixed response length, one optimizer step per generation batch, the same GRPO loss
(token-mean / "dapo", clip 0.2, std-normalised group advantages, no KL, constant lr, grad clip 1)
and one torch thread. Fixed length: TRL suppresses EOS with generate's min_new_tokens = L; plait has
no such knob, so the bench empties its rollout engine's EOS list (rows then always run L tokens).

Each framework runs in its own subprocess (threads and import state cannot leak), alternating
plait / TRL (order swapped every run), several runs each. A run trains warmup + steps + 1 steps;
the timed steps are the `steps` after the warm-up (the last step is dropped: plait writes its
final checkpoint in it). Step time is wall clock between consecutive step ends (everything the
framework does per step, logging included); tokens/s = prompts x n x L / that time. Process CPU
time per step is recorded too: it is steadier when other processes share the cores. Each
framework's time is split into stages: plait's timing_s/*, TRL's by timers the bench wraps around
model.generate, _generate_and_score_completions and training_step.

    python bench/bench_vs_trl.py [--sizes s,m,l] [--runs 3] [--out bench/results/trl.json]

Each run records the load average before and after it (bench/machine.py); a result with a run
started on a busy machine says `"valid": false` and prints why. plait's runs also record its MFU
(perf/mfu/actor, perf/mfu/gen: model FLOPs over this machine's measured matmul peak).

Size `smollm2` is the real model: SmolLM2-135M-Instruct (plait.models.smollm2_dir; needs the
[smollm2] extra) on GSM8K-style word problems (data_source openai/gsm8k, up to 160 prompt tokens),
e.g. `--sizes smollm2 --prompts 4 --n 4 --length 32`. `--varlen` honours EOS (plait without
ignore_eos, TRL without min_new_tokens): response lengths vary, plait runs its variable-length
settings (PLAIT_VARLEN: packing + token-budget micro-batches), TRL its CPU defaults, and the
headline is trained (response) tokens/s over the same timed steps.

Needs `pip install -e .[bench]` (trl==1.16.0). Left out: GPUs, vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from machine import capability, measured, verdict

# plait's fastest settings for variable lengths: packed sequences (use_remove_padding, on by default)
# and micro-batches by a real-token budget (use_dynamic_bsz) for the update and the log-prob passes
PLAIT_VARLEN = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1536")
REAL = "smollm2"  # the real-model size: SmolLM2-135M-Instruct (plait.models.smollm2_dir), GSM8K-style prompts

PLAIT_STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")
TRL_STAGES = ("gen", "prepare_other", "loss_fwd_bwd", "optimizer_other", "between_steps")


@dataclass
class Settings:
    prompts: int = 8        # distinct prompts per step
    n: int = 8              # responses per prompt
    length: int = 32        # response tokens, exactly
    warmup: int = 2         # steps not timed
    steps: int = 8          # timed steps
    lr: float = 1e-5
    clip: float = 0.2
    seed: int = 1
    data_rows: int = 512
    plait_overrides: tuple[str, ...] = ()  # extra plait key=value settings, after the bench's own
    max_prompt: int = 32    # prompt tokens at most (the real model's GSM8K-style prompts: 160)
    varlen: bool = False    # EOS honoured: responses end where the model stops, up to `length`
    mix: bool = False       # smollm2: every other row a one-line sum (short answers) beside the word problems
    device: str = "cpu"     # "cuda": bench/gpu_check.py runs these workers on a GPU
    dtype: str = "float32"  # both frameworks compute in it over float32 weights (bfloat16: autocast / TRL's bf16=True)

    @property
    def tokens_per_step(self) -> int:
        return self.prompts * self.n * self.length


# -- the two workers (each runs in its own process) ----------------------------------------------


def plait_worker(model_dir: str, data_file: str, s: Settings, out_dir: str) -> dict:
    from plait.config import load_config
    from plait.driver import build
    from plait.trainers.lifecycle import read_metrics

    batch = s.prompts * s.n
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data_file}]", "data.val_files=null",
        f"data.train_batch_size={s.prompts}", f"data.max_response_length={s.length}", f"data.max_prompt_length={s.max_prompt}",
        f"data.seed={s.seed}",
        f"actor_rollout_ref.rollout.n={s.n}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.top_p=1.0",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={s.prompts}", "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch}",
        f"actor_rollout_ref.actor.optim.lr={s.lr}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.clip_ratio={s.clip}", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.entropy_coeff=0.0", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true", "algorithm.use_kl_in_reward=false",
        f"trainer.total_training_steps={s.warmup + s.steps + 1}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[]", "trainer.num_threads=1", f"trainer.device={s.device}",
        f"actor_rollout_ref.model.dtype={s.dtype}",
        "trainer.resume_mode=disable", f"trainer.seed={s.seed}", f"trainer.default_local_dir={out_dir}",
        f"actor_rollout_ref.rollout.ignore_eos={not s.varlen}",  # fixed length: exactly L tokens for every row
        *(PLAIT_VARLEN if s.varlen else ()),
        *(["data.shuffle=false"] if s.mix else []),  # mix: rows in file order on both sides, half short each batch
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",  # as TRL here (verl's default is on)
        *s.plait_overrides,
    ])
    lifecycle = build(cfg, progress=False)
    ends = []  # (wall, cpu) when each step's metrics are logged: the step boundary
    log = lifecycle.tracker.log

    def log_and_clock(metrics, step):
        log(metrics, step)
        ends.append((time.perf_counter(), time.process_time()))
    lifecycle.tracker.log = log_and_clock
    start = time.perf_counter()
    lifecycle.run()
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    timed = records[s.warmup:s.warmup + s.steps]
    return {
        "setup_s": round(start - T0, 2),
        "response_length_mean": [r["response_length/mean"] for r in timed],
        "breakdown_s": {k: _median(r.get(f"timing_s/{k}", 0.0) for r in timed) for k in (*PLAIT_STAGES, "step")},
        "mfu": {k: _median(r[f"perf/mfu/{k}"] for r in timed) for k in ("actor", "gen")},
        "old_log_prob_fused": all(r.get("actor/old_log_prob_fused") == 1.0 for r in timed),
        "engine": cfg.actor_rollout_ref.rollout.name, "mode": cfg.trainer.mode,  # what this run used, overrides included
        **_step_times(ends, s, [r["response_length/mean"] for r in timed]),
    }


def trl_worker(model_dir: str, data_file: str, s: Settings, out_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from plait.data.dataset import PromptDataset, load_rows
    from plait.data.rewards import default_compute_score
    from plait.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    items = PromptDataset(load_rows(data_file), tokenizer, max_prompt_length=s.max_prompt).items
    # TRL tokenizes the prompt text itself: it must give plait's ids
    assert all(tokenizer(it.prompt_text)["input_ids"] == it.prompt_ids for it in items[:32])
    data = Dataset.from_list([{"prompt": it.prompt_text, "data_source": it.data_source,
                               "ground_truth": it.ground_truth} for it in items])

    def arithmetic_reward(completions, data_source, ground_truth, **kwargs):
        return [default_compute_score(d, c, g) for d, c, g in zip(data_source, completions, ground_truth)]

    clock = {k: 0.0 for k in TRL_STAGES}  # this step's seconds per stage
    steps, ends, lengths = [], [], []

    class Clock(TrainerCallback):
        begin = 0.0  # perf_counter at this step's begin

        def on_step_begin(self, args, state, control, **kw):
            clock.update({k: 0.0 for k in clock})
            if ends:
                clock["between_steps"] = time.perf_counter() - ends[-1][0]
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            ends.append((now, time.process_time()))
            clock["optimizer_other"] = now - self.begin - clock.pop("_training_step")
            steps.append(dict(clock))

        def on_log(self, args, state, control, logs=None, **kw):
            if "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["prepare_other"] = time.perf_counter() - t - clock["gen"]
            return out

        def training_step(self, *args, **kwargs):
            t = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            clock["_training_step"] = time.perf_counter() - t
            clock["loss_fwd_bwd"] = clock["_training_step"] - clock["gen"] - clock["prepare_other"]
            return out

    config = GRPOConfig(
        output_dir=out_dir, use_cpu=s.device == "cpu", bf16=s.dtype == "bfloat16", gradient_checkpointing=False,
        report_to="none", disable_tqdm=True, logging_steps=1, save_strategy="no", dataloader_num_workers=0, seed=s.seed,
        per_device_train_batch_size=s.prompts * s.n, num_generations=s.n, steps_per_generation=1,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=s.warmup + s.steps + 1,
        max_completion_length=s.length, generation_kwargs={} if s.varlen else {"min_new_tokens": s.length},
        temperature=1.0, top_k=0, top_p=1.0, shuffle_dataset=not s.mix,
        beta=0.0, epsilon=s.clip, loss_type="dapo", scale_rewards="group",
        learning_rate=s.lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0)
    # float32 weights and bf16=True (autocast), as plait's mixed precision: the same dtype offered to both
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=arithmetic_reward, args=config,
                               train_dataset=data, callbacks=[Clock()])
    generate = trainer.model.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        clock["gen"] += time.perf_counter() - t
        return out
    trainer.model.generate = timed_generate
    start = time.perf_counter()
    trainer.train()
    timed = steps[s.warmup:s.warmup + s.steps]
    return {
        "setup_s": round(start - T0, 2),
        "response_length_mean": lengths[s.warmup:s.warmup + s.steps],
        "breakdown_s": {k: _median(st[k] for st in timed) for k in TRL_STAGES},
        **_step_times(ends, s, lengths[s.warmup:s.warmup + s.steps]),
    }


def _step_times(ends: list[tuple[float, float]], s: Settings, lengths: list[float]) -> dict:
    """Wall and CPU seconds of the timed steps, from consecutive step-end clocks; varlen: trained
    (response) tokens over the timed steps' total time."""
    timed = range(s.warmup, s.warmup + s.steps)  # ends[i] closes step i + 1
    wall = [ends[i][0] - ends[i - 1][0] for i in timed]
    cpu = [ends[i][1] - ends[i - 1][1] for i in timed]
    varlen = {"trained_tokens_per_s": round(sum(lengths) * s.prompts * s.n / sum(wall), 1)} if s.varlen else {}
    return {**varlen, "step_wall_s": [round(x, 4) for x in wall], "step_cpu_s": [round(x, 4) for x in cpu],
            "median_step_s": round(statistics.median(wall), 4), "median_step_cpu_s": round(statistics.median(cpu), 4),
            "tokens_per_s": round(s.tokens_per_step / statistics.median(wall), 1),
            "tokens_per_cpu_s": round(s.tokens_per_step / statistics.median(cpu), 1)}


def gsm8k_style_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` grade-school word problems in GSM8K's row format (data_source openai/gsm8k, the answer
    after "####"), a few sentences each: with SmolLM2's chat template 90-160 prompt tokens."""
    import random
    rng = random.Random(seed)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
    items = ["clips", "apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps"]
    rows = []
    for i in range(n):
        who, what = rng.choice(names), rng.choice(items)
        a, b, c, price = rng.randint(3, 60), rng.randint(2, 9), rng.randint(1, 20), rng.randint(1, 12)
        extra = " ".join(rng.sample([
            f"{who} keeps them in a box on the top shelf of the closet.",
            f"On the way home {who} meets a friend and talks about the weather for a while.",
            f"Each of the {what} is a different colour, and {who} likes the blue ones best.",
            f"The shop that sells {what} opens at nine in the morning and closes at six.",
            f"{who} writes the numbers down in a notebook so as not to forget them."], rng.randint(1, 4)))
        question = (f"{who} had {a} {what}. Then {who} bought {b} packs with {c} {what} in each pack. {extra} "
                    f"Each of the {what} costs ${price}. How much are all of {who}'s {what} worth, in dollars?")
        rows.append({"data_source": "openai/gsm8k", "ability": "math",
                     "prompt": [{"role": "user", "content": question + " Let's think step by step and output the "
                                                                       "final answer after \"####\"."}],
                     "reward_model": {"style": "rule", "ground_truth": str((a + b * c) * price)},
                     "extra_info": {"split": "train", "index": i}})
    return rows


def mixed_rows(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-style word problems (long answers: SmolLM2 reasons for 100+ tokens) alternating with one-line
    sums that ask for the answer alone (answers of 10-60 tokens), so a batch's response lengths spread
    over the whole range: the variable-length workload where padding costs and packing pays."""
    import random
    rng = random.Random(seed + 1)
    rows = gsm8k_style_rows(n, seed)
    for i in range(1, n, 2):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows[i] = {**rows[i], "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with \"#### \" "
                                                                      "and the number, nothing else."}],
                   "reward_model": {"style": "rule", "ground_truth": str(a + b)}}
    return rows


def _median(xs) -> float:
    return round(statistics.median(list(xs)), 4)


WORKERS = {"plait": plait_worker, "trl": trl_worker}


# -- the driver --------------------------------------------------------------------------------


def run_worker(framework: str, model_dir: str, data_file: str, s: Settings, scratch: str, tag: str) -> dict:
    """One training run in a fresh process; returns its measurements."""
    out_dir, result = os.path.join(scratch, tag), os.path.join(scratch, f"{tag}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc, load = measured(subprocess.run, [sys.executable, __file__, "--worker", framework, "--model", model_dir, "--data", data_file,
                           "--settings", json.dumps(asdict(s)), "--scratch", out_dir, "--result", result],
                          env=env, capture_output=True, text=True, threads=1)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(Path(result).read_text())
    expected = [float(s.length)] * s.steps
    if not s.varlen and [float(x) for x in out["response_length_mean"]] != expected:
        raise RuntimeError(f"{framework}: responses were not all {s.length} tokens: {out['response_length_mean']}")
    if out["threads_seen"] != 1:
        raise RuntimeError(f"{framework} ran with {out['threads_seen']} torch threads, not 1")
    return {"framework": framework, "load": load, "process_s": round(time.perf_counter() - start, 1), **out}


def summarize(size: str, runs: list[dict]) -> dict:
    by = {f: [r for r in runs if r["framework"] == f] for f in WORKERS}
    row = {"size": size}
    for f, rs in by.items():
        row[f"{f}_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in rs), 1)
        row[f"{f}_tokens_per_cpu_s"] = round(statistics.median(r["tokens_per_cpu_s"] for r in rs), 1)
        row[f"{f}_step_s"] = round(statistics.median(r["median_step_s"] for r in rs), 4)
        row[f"{f}_breakdown_s"] = {k: _median(r["breakdown_s"][k] for r in rs) for k in rs[0]["breakdown_s"]}
    row["ratio"] = round(row["plait_tokens_per_s"] / row["trl_tokens_per_s"], 2)
    row["ratio_cpu"] = round(row["plait_tokens_per_cpu_s"] / row["trl_tokens_per_cpu_s"], 2)
    # per-run pairs (adjacent processes): the spread of the ratio under the machine's load
    pairs = [p["tokens_per_s"] / t["tokens_per_s"] for p, t in zip(by["plait"], by["trl"])]
    row["ratio_per_run"] = [round(x, 2) for x in pairs]
    row["plait_mfu"] = {k: _median(r["mfu"][k] for r in by["plait"]) for k in ("actor", "gen")}
    if "trained_tokens_per_s" in runs[0]:  # varlen: the headline is trained tokens/s
        for f, rs in by.items():
            row[f"{f}_trained_tokens_per_s"] = round(statistics.median(r["trained_tokens_per_s"] for r in rs), 1)
            row[f"{f}_response_length_mean"] = _median(x for r in rs for x in r["response_length_mean"])
        row["trained_ratio"] = round(row["plait_trained_tokens_per_s"] / row["trl_trained_tokens_per_s"], 2)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="s,m,l")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=Settings.prompts)
    ap.add_argument("--n", type=int, default=Settings.n)
    ap.add_argument("--length", type=int, default=Settings.length)
    ap.add_argument("--warmup", type=int, default=Settings.warmup)
    ap.add_argument("--steps", type=int, default=Settings.steps)
    ap.add_argument("--varlen", action="store_true", help="EOS honoured: variable response lengths, each "
                    "side's fastest settings, trained tokens/s")
    ap.add_argument("--mix", action="store_true", help="smollm2: every other prompt a one-line sum asking for "
                    "the number alone, so response lengths spread (use with --varlen)")
    ap.add_argument("--plait-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra plait setting, e.g. algorithm.rollout_correction.bypass_mode=true")
    ap.add_argument("--dtype", default=Settings.dtype, choices=["float32", "bfloat16"],
                    help="both frameworks' compute dtype (float32 weights); plait's MFU uses its matmul peak")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trl.json"))
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch
        torch.set_num_threads(1)
        out = WORKERS[args.worker](args.model, args.data, Settings(**json.loads(args.settings)), args.scratch)
        out["threads_seen"] = torch.get_num_threads()  # after training: neither framework may have raised it
        Path(args.result).write_text(json.dumps(out))
        return

    import torch
    import transformers
    import trl

    from plait.data.tasks import make_task_rows
    from plait.models import smollm2_dir
    from llama_model import create_model
    import pyarrow as pa
    import pyarrow.parquet as pq

    s = Settings(prompts=args.prompts, n=args.n, length=args.length, warmup=args.warmup, steps=args.steps,
                 plait_overrides=tuple(args.plait_override), varlen=args.varlen, dtype=args.dtype,
                 mix=args.mix)
    sizes = args.sizes.split(",")
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "nproc": os.cpu_count(),
                    "load_avg_before": [round(x, 2) for x in os.getloadavg()], **capability(s.device)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "plait_commit": _git_commit()},
        "threads": 1, "settings": {**asdict(s), "tokens_per_step": s.tokens_per_step,
                                   "task": f"arithmetic ({REAL}: GSM8K-style word problems, up to 160 prompt tokens"
                                           + (", every other row a one-line sum asking for the number alone)" if s.mix else ")"),
                                   "loss": "GRPO token-mean (TRL loss_type=dapo), beta=0, std-normalised advantages",
                                   "plait_varlen_settings": list(PLAIT_VARLEN) if s.varlen else [],
                                   "trl_settings": "GRPOTrainer on CPU, no gradient checkpointing, one generation "
                                                   "batch per optimizer step, HF generate"},
        "command": "python bench/bench_vs_trl.py " + " ".join(sys.argv[1:]), "runs": [], "summary": [],
    }
    with tempfile.TemporaryDirectory(prefix="plait_bench_trl_") as scratch:
        data_file = os.path.join(scratch, "arithmetic_train.parquet")
        pq.write_table(pa.Table.from_pylist(make_task_rows("arithmetic", "train", s.data_rows, seed=0)), data_file)
        gsm8k_file = os.path.join(scratch, "gsm8k_style_train.parquet")
        pq.write_table(pa.Table.from_pylist((mixed_rows if s.mix else gsm8k_style_rows)(s.data_rows)), gsm8k_file)
        models = {size: smollm2_dir() if size == REAL else create_model(os.path.join(scratch, f"model_{size}"), size, seed=0)
                  for size in sizes}
        for i in range(args.runs):
            for size in sizes:
                order = ("plait", "trl") if i % 2 == 0 else ("trl", "plait")
                ss = replace(s, max_prompt=160) if size == REAL else s
                for framework in order:
                    run = run_worker(framework, models[size], gsm8k_file if size == REAL else data_file, ss, scratch,
                                     f"{framework}_{size}_{i}")
                    result["runs"].append({"size": size, "run": i, **run})
                    print(f"run {i} {size} {framework:>5}: {run['tokens_per_s']:>8.0f} tok/s  "
                          f"step {run['median_step_s']:.3f} s  (load {run['load']['load_before']} -> "
                          f"{run['load']['load_after']}{'' if run['load']['valid'] else ', BUSY'})", flush=True)
    result["summary"] = [summarize(size, [r for r in result["runs"] if r["size"] == size]) for size in sizes]
    result["machine"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    result.update(verdict([r["load"] for r in result["runs"]]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


def _git_commit() -> str | None:
    """HEAD of the checkout the bench runs from, "+dirty" when the working tree has changes."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=Path(__file__).parent, capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").stdout.strip() else "")


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"\n{s['prompts']} prompts x {s['n']} x {s['length']} tokens = {s['tokens_per_step']} tokens/step, "
          f"1 thread, medians of {len(result['runs']) // (2 * len(result['summary']))} runs")
    print(f"{'size':>4} | {'plait tok/s':>11} {'TRL tok/s':>9} {'ratio':>5} | {'plait s/step':>12} {'TRL s/step':>10} | "
          f"{'CPU-time ratio':>14}")
    for row in result["summary"]:
        print(f"{row['size']:>4} | {row['plait_tokens_per_s']:>11.0f} {row['trl_tokens_per_s']:>9.0f} {row['ratio']:>5} | "
              f"{row['plait_step_s']:>12.3f} {row['trl_step_s']:>10.3f} | {row['ratio_cpu']:>14}")
    for row in result["summary"]:
        if "trained_ratio" in row:
            print(f"  {row['size']} trained tokens/s (EOS honoured): plait {row['plait_trained_tokens_per_s']:.0f}, "
                  f"TRL {row['trl_trained_tokens_per_s']:.0f}, ratio {row['trained_ratio']}")
        print(f"  {row['size']} plait MFU: update_actor {row['plait_mfu']['actor']:.1%}, gen {row['plait_mfu']['gen']:.1%}")
        for f in WORKERS:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in row[f"{f}_breakdown_s"].items())
            print(f"  {row['size']} {f} s/step: {parts}")


T0 = time.perf_counter()

if __name__ == "__main__":
    main()
