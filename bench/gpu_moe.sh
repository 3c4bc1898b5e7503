#!/usr/bin/env bash
# Qwen3-MoE on a lent GPU machine, from the repo root (results under $OUT, default bench/out):
#   bench/gpu_moe.sh [all|tests|tune|bench|dense|tp|fp8|fp8-bench]
# all (one GPU, < 8 minutes): tests/gpu/test_moe_gpu.py; the launch configs tuned at 1, 8, 64 and 256
# tokens for the 30B-A3B layer (bench/tune_moe.py: the config file in $OUT, and used by what follows);
# then Qwen3-30B-A3B's shape on dummy weights: batch-1 decode through gRPC (bench/latency.py) and the DESIGN
# throughput workload (bench/throughput.py). Random routers spread tokens evenly over the experts.
# dense: the DESIGN throughput at the dense 8B shape, to set beside the 30B-A3B figure (same machine).
# tp (two GPUs): tests/gpu/test_moe_tensor_parallel_gpu.py.
# fp8 (one GPU, < 8 minutes): the 30B-A3B shape with FP8 experts and projections (Qwen's block format, dummy
# weights): tests/gpu/test_moe_fp8_gpu.py, the e4m3 experts' launch configs tuned at 1, 8, 64 and 256 tokens
# (bench/tune_moe.py --fp8: E128_N768_<GPU>_fp8.json in $OUT and used by what follows), batch-1 and batch-8
# decode through gRPC and the DESIGN throughput workload. fp8-bench: the same without the tests and tuning.
source bench/gpu_env.sh
mode=${1:-all}
# One log of what is printed (the device returns few files): the JSON results and the tuned configs beside it.
exec > >(tee "$out/gpu_moe.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
a3b=.cache/qwen3-30b-a3b-dummy
python3 -m nanoserve_cli.demo_model "$a3b" --shape qwen3-30b-a3b --no-weights >/dev/null
if [ "$mode" = fp8 ] || [ "$mode" = fp8-bench ]; then
  a3b_fp8=.cache/qwen3-30b-a3b-fp8-dummy
  python3 -m nanoserve_cli.demo_model "$a3b_fp8" --shape qwen3-30b-a3b --quantization fp8 --no-weights >/dev/null
  if [ "$mode" = fp8 ]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_fp8_gpu.py 2>&1 | tail -8
    timeout 140 python3 bench/tune_moe.py --fp8 --batches 1 8 64 256 --config-dir "$out" \
      --out "$out/tune_moe_fp8.json" 2>&1 | tail -8
    mkdir -p nanoserve_kernels/moe_configs && cp "$out"/E*_fp8.json nanoserve_kernels/moe_configs/
  fi
  timeout 100 python3 bench/latency.py --model "$a3b_fp8" --repeats 5 --prompt-lens 16 512 --batches 1 8 \
    --itl-tokens 128 --extra "--load-format dummy --attention-backend triton --max-model-len 4096" \
    --out "$out/latency_30b_a3b_fp8.json" 2>&1 | grep -v " INFO " | tail -9
  timeout 130 python3 bench/throughput.py --model "$a3b_fp8" --attention-backend triton \
    --extra "--load-format dummy" --out "$out/throughput_30b_a3b_fp8.json" 2>&1 | grep -v " INFO " | tail -16
  exit
fi
if [ "$mode" = tp ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_tensor_parallel_gpu.py 2>&1 | tail -8
  exit
fi
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py 2>&1 | tail -12
fi
if [ "$mode" = all ] || [ "$mode" = tune ]; then
  timeout 170 python3 bench/tune_moe.py --batches 1 8 64 256 --config-dir "$out" --out "$out/tune_moe.json" 2>&1 \
    | tail -8
  mkdir -p nanoserve_kernels/moe_configs && cp "$out"/E*.json nanoserve_kernels/moe_configs/
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  timeout 120 python3 bench/latency.py --model "$a3b" --repeats 5 --prompt-lens 16 512 --batches 1 8 \
    --itl-tokens 128 --extra "--load-format dummy --attention-backend triton --max-model-len 4096" \
    --out "$out/latency_30b_a3b.json" 2>&1 | grep -v " INFO " | tail -9
  timeout 150 python3 bench/throughput.py --model "$a3b" --attention-backend triton --extra "--load-format dummy" \
    --out "$out/throughput_30b_a3b.json" 2>&1 | grep -v " INFO " | tail -16
fi
if [ "$mode" = dense ]; then
  python3 -m nanoserve_cli.demo_model .cache/qwen3-8b-dummy --shape qwen3-8b --no-weights >/dev/null
  timeout 200 python3 bench/throughput.py --model .cache/qwen3-8b-dummy --attention-backend triton \
    --extra "--load-format dummy" --out "$out/throughput_8b.json" 2>&1 | grep -v " INFO " | tail -16
fi
