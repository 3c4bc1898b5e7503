#!/usr/bin/env bash
# On a lent GPU machine, from the repo root: builds the minimal flash-attn (when .fa/ is carried),
# runs tests/gpu and the service suites on CUDA (a two-rank case skips on one GPU), then the throughput
# benchmark.
#   bench/gpu_checks.sh [tests|bench|all|tp|release|mixed]   (results under $OUT, default bench/out)
# `release` fits one 10-minute call: tests/gpu, then throughput and latency on the 0.6B shape (triton),
# the 8B shape at default flags on dummy weights, and throughput with flash-attn (built meanwhile).
# `tp` (on nvidia-h200-x2): two ranks against one on GPU (tests/gpu/test_tensor_parallel*_gpu.py), the
# tensor-parallel service tests on CUDA, then throughput at 1 and 2 ranks.
# `mixed` (issue 15, one 10-minute call): the heavy workload with and without chunked prefill, then the
# online benchmark at 8 and 32 requests per second, on the 0.6B shape (triton).
source bench/gpu_env.sh
mode=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mode" = mixed ]; then
  for chunked in enable no-enable; do
    timeout 200 python3 bench/throughput.py --workload heavy --attention-backend triton \
      --extra "--$chunked-chunked-prefill" --out "$out/throughput_heavy_$chunked.json" 2>&1 \
      | tee "$out/throughput_heavy_$chunked.log" | grep -v " INFO " | tail -22
  done
  timeout 180 python3 bench/serve.py --model .cache/qwen3-0.6b-random --request-rates 8 32 --num-prompts 400 \
    --extra "--attention-backend triton" --out "$out/serve.json" 2>&1 | grep -v " INFO " | tail -6
  exit
fi
if [ "$mode" = release ]; then
  [ -f .fa/flash_attn-2.8.3.tar.gz ] && { bash .fa/flash-attn-minimal.sh build .fa > "$out/fa_build.log" 2>&1 & }
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -12
  timeout 100 python3 bench/throughput.py --attention-backend triton --out "$out/throughput_triton.json" \
    2>&1 | tee "$out/throughput_triton.log" | grep -v " INFO " | tail -16
  timeout 90 python3 bench/latency.py --model .cache/qwen3-0.6b-random --repeats 10 --prompt-lens 16 512 2048 \
    --batches 1 8 64 --itl-tokens 128 --extra "--attention-backend triton --max-model-len 4096" \
    --out "$out/latency.json" 2>&1 | grep -v " INFO " | tail -9
  python3 -m nanoserve_cli.demo_model .cache/qwen3-8b-dummy --shape qwen3-8b --no-weights >/dev/null
  timeout 150 python3 bench/throughput.py --model .cache/qwen3-8b-dummy --attention-backend triton \
    --extra "--load-format dummy" --out "$out/throughput_8b.json" 2>&1 | tee "$out/throughput_8b.log" \
    | grep -v " INFO " | tail -16
  wait
  [ -d .fa/fa_pkg ] && PYTHONPATH=$PYTHONPATH:$PWD/.fa/fa_pkg timeout 90 python3 bench/throughput.py \
    --attention-backend flash-attn --out "$out/throughput_flash-attn.json" 2>&1 | grep -v " INFO " | tail -16
  exit
fi
if [ -f .fa/flash_attn-2.8.3.tar.gz ] && [ ! -d .fa/fa_pkg ]; then
  bash .fa/flash-attn-minimal.sh build .fa > "$out/fa_build.log" 2>&1 || echo "flash-attn build failed"
fi
[ -d .fa/fa_pkg ] && export PYTHONPATH=$PYTHONPATH:$PWD/.fa/fa_pkg
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
  NANOSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/services/test_integration.py \
    tests/services/test_generation_api.py tests/services/test_fp8_service.py tests/services/test_model_families.py \
    2>&1 | tee "$out/services_cuda.log" | tail -8
fi
if [ "$mode" != tests ]; then
  for backend in ${BACKENDS:-triton flash-attn}; do
    python3 bench/throughput.py --attention-backend "$backend" --out "$out/throughput_$backend.json" \
      2>&1 | tee "$out/throughput_$backend.log" | grep -v " INFO " | tail -22
  done
fi
