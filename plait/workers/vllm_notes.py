"""What vLLM's own profiler records, said without starting vLLM: torch-free, so config.py can print it
at start and vllm_engine.py can turn the token range into vLLM's iteration bounds."""

from __future__ import annotations

import os


def iteration_bounds(tokens: tuple[int | None, int | None] | None) -> dict:
    """The rollout's (profile_token_start, profile_token_end) as verl passes them to vLLM's start_profile:
    wait `start` engine iterations (one decode token per running sequence each), then record `end - start`
    of them (max_iterations 0: to the window's end). None or (None, None): no bounds."""
    if tokens is None or tokens == (None, None):
        return {}
    start, end = tokens[0] or 0, tokens[1]
    return {"delay_iterations": start, "max_iterations": 0 if end is None else end - start}


def profiling_note(tool: str, discrete: bool, cuda: bool, tokens: tuple = (None, None)) -> str:
    """The line said at start when rollout.name=vllm is profiled: what the engine-core process's
    record holds and what it does not, and why."""
    if tool == "nsys":
        return ("rollout.name=vllm with nsys: the engine-core process marks each window with vLLM's CUDA profiler "
                "range (launch plait under nsys with --capture-range=cudaProfilerApi); plait's NVTX stage ranges "
                "are in the rollout worker's process only")
    if tool == "memray":
        return ("rollout.name=vllm with memray: the generation runs in vLLM's engine-core process, which memray does "
                "not follow (one tracker per process, started in plait's); the rollout worker's capture holds that "
                "process's allocations only, not the engine's weights, KV cache or activations")
    held = "its model ops" + (" and allocations" if tool == "torch_memory" else "")
    missing = []
    if discrete:
        missing.append("no per-stage split there (discrete traces are the worker's; the engine's is one trace a window)")
    if tool == "torch_memory":
        missing.append("no CUDA allocator snapshot (.pickle) of it: vLLM's profiler has none" if cuda else
                       f"not the KV cache ({os.environ.get('VLLM_CPU_KVCACHE_SPACE', '1')} GiB, "
                       "VLLM_CPU_KVCACHE_SPACE): vLLM allocates it at start, before any window")
    bounds = iteration_bounds(tokens) if tool == "torch" else {}
    if bounds:
        start, count = bounds["delay_iterations"], bounds["max_iterations"]
        missing.append(f"only engine iterations {start} to {start + count - 1 if count else 'the last'} of each window: "
                       "profile_token_start/end become vLLM's delay_iterations/max_iterations, counted from the "
                       "window's start, not per generate call")
    return (f"rollout.name=vllm with {tool}: the generation runs in vLLM's engine-core process, recorded by "
            f"vLLM's own torch profiler as rollout_rank<r>_vllm_engine.pt.trace.json.gz ({held})"
            + ("; " + "; ".join(missing) if missing else ""))
