#!/usr/bin/env bash
# The GPU proof (issue 13) in one device call: bench/gpu_check.py on the H200 machine, ~5-7 minutes.
#
# 1. Here, before the call: fetch the wheels the device machine lacks into .whl/ (gitignored, ~25 MiB):
#        bash bench/gpu_run.sh fetch
#    trl 1.16.0 and what it needs there (datasets, dill, multiprocess), nvtx (plait's nsys tool),
#    diffusers (+ importlib_metadata) for the diffusers-pipeline gpu tests, and transformers 5.24.0,
#    the version plait is developed against (the machine has 5.17).
# 2. The device tool's run:  command "PLAIT_COMMIT=<git rev-parse --short HEAD> bash bench/gpu_run.sh"
#    carry [".whl"]  timeout_s 450  (the copy there has no .git: PLAIT_COMMIT names what ran).
#    A rerun of some checks: "... bash bench/gpu_run.sh --only fsdp2_world,bench_vs_trl".
#    No check starts after --budget-s 330; the results JSON is rewritten after every check.
# 3. Back here: $OUT's gpu_check_cuda.json goes to bench/results/ (committed); gpu_check.log, env.txt
#    and artifacts.tgz (the runs' profiler artifacts, for `plait profile report`) are for reading.
set -u
if [ "${1:-}" = fetch ]; then
    "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 nvtx==0.2.17 transformers==5.24.0 \
        diffusers==0.42.1 importlib_metadata==10.2.0
    exit
fi
: "${OUT:?run this on the device machine (OUT is set there); here: bash bench/gpu_run.sh fetch}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi; python3 -m pip show torch transformers tokenizers huggingface-hub accelerate peft pyarrow fsspec regex \
    | grep -E '^(Name|Version|Location)'; } >"$OUT/env.txt" 2>&1
timeout 420 python3 bench/gpu_check.py --device cuda --budget-s 330 --work /tmp/gpu_check \
    --out "$OUT/gpu_check_cuda.json" "$@" >"$OUT/gpu_check.log" 2>&1
rc=$?
grep '^gpu_check:' "$OUT/gpu_check.log"
tar czf "$OUT/artifacts.tgz" -C /tmp/gpu_check --exclude='*.safetensors' --exclude='*.pt' --exclude='*.parquet' \
    --exclude=bench_model --exclude='m' . 2>/dev/null
[ "$(stat -c %s "$OUT/artifacts.tgz")" -lt 16000000 ] || rm -f "$OUT/artifacts.tgz"  # the tool's 16 MiB a file
exit $rc
