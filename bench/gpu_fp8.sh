#!/usr/bin/env bash
# FP8 weights (issue 38) on a lent GPU, from the repo root; results under $OUT (default bench/out).
#   bench/gpu_fp8.sh [speed|perf|all|quick|bench|tune]   (speed when none is named)
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
# speed (< 8 minutes, each step cut to what is left): the kernels' test of tests/gpu/test_fp8_weights_gpu.py;
#   the batch-1 e4m3 gemv sweep (bench/gemv.py --fp8 block --sweep: tiles x conversions, the winner and the
#   bf16 call's time written as bucket 1 of nanoserve_kernels/fp8_configs.json); bench/tune_fp8.py --recheck
#   at the decode buckets with the bf16 candidate (the rule of fp8_configs.served_in_bf16, which serving
#   applies at start); then bench/fp8_pairs.py: 8B bf16 / FP8 (batch-1 ITL, TTFT@512, DESIGN throughput),
#   0.6B bf16 / FP8, 8B FP8 + FP8 KV; the file's other tests in the time left. $OUT/fp8_configs.json is the
#   table to commit; $OUT/summary.log the results.
# perf (< 9 minutes, each step cut to what is left; FP8_PERF_BUDGET_S, default 530): self-tuning, for the 8B
#   targets: the kernels' test; the batch-1 e4m3 gemv sweep on the 8B shapes (a grid around the stored tiles);
#   bench/tune_fp8.py --shapes 8b with every candidate (tiles, K split 1/2/4, TMA, SWAP_AB, scaled_mm, DeepGEMM
#   if .dg/ holds it) at the buckets 256 to 32 (the most served first), then 512 and 2048 rows while its time
#   lasts, which writes nanoserve_kernels/fp8_configs.json; bench/fp8_pairs.py 8B bf16 / FP8 / FP8 + FP8 KV
#   served with that table; the file's other tests last. $OUT: fp8_configs.json (commit it), tune_fp8.log and
#   gemv_fp8_block.json (every candidate's time), pairs.json, summary.log.
mode=${1:-speed}
source bench/gpu_env.sh
export OUT=$out
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mode" = tune ]; then
  timeout 560 python3 bench/tune_fp8.py --budget-s 500 2>&1 | tee "$out/tune_fp8.log" | tail -120
  cp nanoserve_kernels/fp8_configs.json "$out/"
  exit
fi
if [ "$mode" = speed ] || [ "$mode" = perf ]; then
  if [ "$mode" = perf ]; then
    end=$((SECONDS + ${FP8_PERF_BUDGET_S:-530})) shapes=qwen3-8b gemv_s=95 tune_s=170 pairs_s=200 pairs_after=90
    gemv=(--models 8b --budget-s 20) tune=(--shapes 8b --buckets 256 128 64 32 512 2048 --budget-s 150)
    pairs=(--only 8b_bf16 8b_fp8 8b_fp8_kvfp8)
  else
    end=$((SECONDS + ${FP8_SPEED_BUDGET_S:-470})) shapes="qwen3-8b qwen3-0.6b" gemv_s=120 tune_s=75 pairs_s=300
    pairs_after=45 gemv=(--models 8b 0.6b --budget-s 25) pairs=()
    tune=(--shapes 0.6b 8b --recheck --budget-s 60 --buckets 2 4 8 16 32 64 128 256)
  fi
  left() { echo $((end - SECONDS > 1 ? end - SECONDS : 1)); }
  upto() { echo $(($(left) < $1 ? $(left) : $1)); }  # seconds for a step: at most $1, at most what is left
  tests=tests/gpu/test_fp8_weights_gpu.py
  for shape in $shapes; do  # the shapes' configs, beside the first test (CPU only)
    python3 -m nanoserve_cli.demo_model ".cache/$shape-dummy" --shape "$shape" --no-weights >/dev/null &
    python3 -m nanoserve_cli.demo_model ".cache/$shape-fp8-dummy" --shape "$shape" --quantization fp8 --no-weights \
      >/dev/null &
  done
  kernels=test_quantize_gemm_and_gemv_match_the_reference_in_bfloat16  # the new kernels first; the rest last
  fused=test_the_norm_quantizing_for_the_projection_gives_the_unfused_output
  timeout 120 python3 -m pytest -q -p no:cacheprovider "$tests::$kernels" "$tests::$fused" \
    > "$out/fp8_gpu_tests.log" 2>&1
  wait
  timeout $(upto $gemv_s) python3 bench/gemv.py --fp8 block --sweep "${gemv[@]}" \
    --out "$out/gemv_fp8_block.json" > "$out/gemv_sweep.log" 2>&1
  # DeepGEMM (where .dg/ holds it) prints the tiles it picks for each shape into the log
  DG_PRINT_CONFIGS=1 timeout $(upto $tune_s) python3 bench/tune_fp8.py "${tune[@]}" > "$out/tune_fp8.log" 2>&1
  cp nanoserve_kernels/fp8_configs.json "$out/"
  timeout $(upto $pairs_s) python3 bench/fp8_pairs.py --budget-s $(($(left) - pairs_after)) --out-dir "$out" \
    "${pairs[@]}" > "$out/pairs.log" 2>&1
  timeout $(left) python3 -m pytest -q -p no:cacheprovider "$tests" --deselect "$tests::$kernels" \
    --deselect "$tests::$fused" 2>&1 \
    | grep -v "^Loading weights" >> "$out/fp8_gpu_tests.log"
  {
    echo "== $tests (the kernels' test, then the others in what time was left)"
    grep -E "passed|failed|error|Error" "$out/fp8_gpu_tests.log" | tail -8
    echo "== batch-1 e4m3 gemv (bench/gemv.py --fp8 block --sweep ${gemv[*]})"
    grep -v "^  " "$out/gemv_sweep.log" | tail -14
    echo "== decode buckets, FP8 vs bf16 (bench/tune_fp8.py ${tune[*]})"
    grep -E "rows|served in bf16|wrote|budget" "$out/tune_fp8.log"
    echo "== at start"; grep -h "served in bf16\|weights in" "$out"/server_*.log | cut -c1-300
    echo "== pairs (bench/fp8_pairs.py)"; grep -v " INFO \| WARNING " "$out/pairs.log" | tail -14
  } > "$out/summary.log" 2>&1
  cat "$out/summary.log"
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
