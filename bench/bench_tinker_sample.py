"""Sampling throughput of plait's local Tinker through the real `tinker` SDK (docs/tinker.md "Measured").

A server on 127.0.0.1 over a tiny Qwen2 (`create_tiny_model(size=...)`), one LoRA client trained one step, its
sampler asked for NUM x MAX_TOKENS tokens (stop=[]: no EOS stop where the engine allows it) several times; prints
the generated tokens per second of wall clock and per second of this process's CPU time (server and SDK: the
measure that holds on a machine other jobs share), medians of the repeats, and the first call's time (its
engine build and weight load included). torch runs on one thread (--threads).

    PYTHONPATH=$PWD python bench/bench_tinker_sample.py [--size s] [--num 8] [--max-tokens 64] [--repeats 5]
"""

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="s")
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker
    from tinker import types

    from plait.config import RolloutConfig
    from plait.models import create_tiny_model
    from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
    from plait.profiler.session import ProfilerSession
    from plait.serving.serve import ModelServer
    with tempfile.TemporaryDirectory() as root:
        path = create_tiny_model(os.path.join(root, "model"), size=args.size, seed=0)
        profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
        server = ModelServer(path, RolloutConfig(name="hf"), profiler, name="bench", max_tokens=args.max_tokens,
                             tinker_dir=os.path.join(root, "ckpt"))
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
            client = service.create_lora_training_client(base_model="bench", rank=8, seed=0).result()
            ids = server.gateway.tokenizer.encode("hello tinker, hello plait")
            datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
            client.forward_backward([datum], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            sampler = client.save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
            prompt = types.ModelInput.from_ints(ids[:8])
            rates, cpu_rates, first, counts = [], [], None, []
            for i in range(args.repeats + 1):
                start, cpu = time.perf_counter(), time.process_time()
                out = sampler.sample(prompt, args.num, params).result()
                took, cpu = time.perf_counter() - start, time.process_time() - cpu
                tokens = sum(len(s.tokens) for s in out.sequences)
                counts.append(tokens)
                if i == 0:
                    first = took
                else:
                    rates.append(tokens / took)
                    cpu_rates.append(tokens / cpu)
            print(f"tinker sample: {args.num} x {args.max_tokens} tokens, size={args.size}: "
                  f"{statistics.median(rates):.0f} tokens/s wall, {statistics.median(cpu_rates):.0f} tokens per CPU second (median of {args.repeats}; tokens per call {min(counts)}..{max(counts)}; first call {first:.2f} s)")
            service.close("success").result()
        finally:
            server.close()


if __name__ == "__main__":
    main()
