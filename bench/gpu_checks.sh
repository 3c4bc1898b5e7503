#!/usr/bin/env bash
# On a lent GPU machine, from the repo root: builds the minimal flash-attn (when .fa/ is carried),
# runs tests/gpu and the service integration suite on CUDA, then the throughput benchmark.
#   bench/gpu_checks.sh [tests|bench|all|tp]   (results under $OUT, default bench/out)
# `tp` (on nvidia-h200-x2): two ranks against one on GPU (tests/gpu/test_tensor_parallel*_gpu.py), the
# tensor-parallel service tests on CUDA, then throughput at 1 and 2 ranks.
set -uo pipefail
mode=${1:-all}
out=${OUT:-bench/out}; mkdir -p "$out"
export PYTHONPATH=$PWD:$PWD/proto PYTHONUNBUFFERED=1 NANOSERVE_CACHE=$PWD/.cache
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (health, reflection)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -f .fa/flash_attn-2.8.3.tar.gz ] && [ ! -d .fa/fa_pkg ]; then
  bash .fa/flash-attn-minimal.sh build .fa > "$out/fa_build.log" 2>&1 || echo "flash-attn build failed"
fi
[ -d .fa/fa_pkg ] && export PYTHONPATH=$PYTHONPATH:$PWD/.fa/fa_pkg
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mode" = tp ]; then
  timeout 540 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    tests/gpu/test_tensor_parallel_8b_gpu.py 2>&1 | tee "$out/tp_gpu_test.log" | tail -15
  NANOSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/services/test_tensor_parallel.py \
    -k "two_ranks_generate or client_against" 2>&1 | tee "$out/tp_tests.log" | tail -8
  for tp in 1 2; do
    timeout 240 python3 bench/throughput.py --tensor-parallel-size "$tp" --attention-backend triton \
      --out "$out/throughput_tp$tp.json" 2>&1 | tee "$out/throughput_tp$tp.log" | grep -v " INFO " | tail -18
  done
  exit
fi
if [ "$mode" != bench ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -15
  NANOSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/services/test_integration.py 2>&1 \
    | tee "$out/integration_cuda.log" | tail -8
fi
if [ "$mode" != tests ]; then
  for backend in ${BACKENDS:-triton flash-attn}; do
    python3 bench/throughput.py --attention-backend "$backend" --out "$out/throughput_$backend.json" \
      2>&1 | tee "$out/throughput_$backend.log" | grep -v " INFO " | tail -22
  done
fi
