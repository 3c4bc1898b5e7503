#!/usr/bin/env bash
# On a lent machine with two GPUs (nvidia-h100-x2), from the repo root: a tensor-parallel group of two
# ranks (NCCL), each with an address of its own, rank 1 SIGKILLed mid-stream and restarted alone; every
# greedy and seeded stream must end with the tokens of an undisturbed run (tests/gpu/test_failover_gpu.py).
# Writes $OUT/gpu_failover.json (both runs' tokens, how long the scheduler waited for the group) and the
# test's log; about 2 minutes.
set -uo pipefail
out=${OUT:-bench/out}; mkdir -p "$out"; export OUT=$out
export PYTHONPATH=$PWD:$PWD/proto PYTHONUNBUFFERED=1 NANOSERVE_CACHE=$PWD/.cache
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (health, reflection)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_failover_gpu.py 2>&1 \
  | tee "$out/gpu_failover.log" | grep -E "^failover:|passed|failed|skipped|Error" | tail -8
