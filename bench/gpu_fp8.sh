#!/usr/bin/env bash
# FP8 weights (issue 38) on a lent GPU, from the repo root; results under $OUT (default bench/out).
#   bench/gpu_fp8.sh [all|quick|bench|tune]
# all (< 9 minutes): tests/gpu/test_fp8_weights_gpu.py (kernels vs reference in bf16, the dispatch at
#   M = 1, 2, 7, 64, 300, 4096, scaled_mm, the step graphs, the W8A8 next-token KL beside the bf16 floor),
#   then on dummy weights, each set one after the other: the 8B shape's batch-1 decode (bench/latency.py)
#   bf16 vs Qwen block FP8 vs --quantization fp8 (per channel); the throughput workload (docs/benchmarks.md)
#   on the 8B shape bf16, FP8, FP8 + FP8 KV; the 0.6B shape bf16 vs FP8 on throughput and batch 1.
#   Launch choices: nanoserve_kernels/fp8_configs.json.
# quick (< 6 minutes): the tests, then the 8B shape's batch-1 decode and throughput, bf16 vs FP8.
# bench (< 8 minutes): all but the tests (for a call that runs tests/gpu whole).
# tune (~5 minutes): bench/tune_fp8.py for the 0.6B and 8B shapes on this GPU; the table it writes is
#   copied to $OUT/fp8_configs.json (commit it as nanoserve_kernels/fp8_configs.json).
set -uo pipefail
mode=${1:-all}
out=${OUT:-bench/out}; mkdir -p "$out"
export PYTHONPATH=$PWD:$PWD/proto PYTHONUNBUFFERED=1 NANOSERVE_CACHE=$PWD/.cache OUT=$out
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (health, reflection)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mode" = tune ]; then
  timeout 560 python3 bench/tune_fp8.py --budget-s 500 2>&1 | tee "$out/tune_fp8.log" | tail -120
  cp nanoserve_kernels/fp8_configs.json "$out/"
  exit
fi
[ "$mode" = bench ] || timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_weights_gpu.py 2>&1 \
  | tee "$out/fp8_gpu_tests.log" | grep -v "^Loading weights" | tail -12
for shape in qwen3-8b qwen3-0.6b; do
  python3 -m nanoserve_cli.demo_model ".cache/$shape-dummy" --shape "$shape" --no-weights >/dev/null
  python3 -m nanoserve_cli.demo_model ".cache/$shape-fp8-dummy" --shape "$shape" --quantization fp8 --no-weights >/dev/null
done
dummy="--load-format dummy --attention-backend triton"
latency() {  # shape, name, extra flags
  timeout 75 python3 bench/latency.py --model ".cache/$1" --repeats 5 --prompt-lens 512 --batches 1 --itl-tokens 128 \
    --extra "$dummy --max-model-len 4096 ${3:-}" --out "$out/latency_$2.json" 2>&1 | grep -v " INFO " | tail -6
}
throughput() {  # shape, name, extra flags
  timeout 100 python3 bench/throughput.py --model ".cache/$1" --attention-backend triton --extra "$dummy ${3:-}" \
    --out "$out/throughput_$2.json" 2>&1 | tee "$out/throughput_$2.log" | grep -v " INFO " | tail -8
}
latency qwen3-8b-dummy 8b_bf16
latency qwen3-8b-fp8-dummy 8b_fp8
throughput qwen3-8b-dummy 8b_bf16
throughput qwen3-8b-fp8-dummy 8b_fp8
[ "$mode" = quick ] && exit
throughput qwen3-0.6b-dummy 06b_bf16
throughput qwen3-0.6b-fp8-dummy 06b_fp8
latency qwen3-0.6b-dummy 06b_bf16
latency qwen3-0.6b-fp8-dummy 06b_fp8
throughput qwen3-8b-fp8-dummy 8b_fp8_kvfp8 "--kv-cache-dtype fp8"
latency qwen3-8b-dummy 8b_fp8_per_channel "--quantization fp8"
