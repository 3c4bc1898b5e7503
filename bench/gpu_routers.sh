#!/usr/bin/env bash
# On a lent two-GPU machine (nvidia-h100-x2 or nvidia-h200-x2), from the repo root, with .whl/ carried
# (SMG, pyzmq and the gateway's wheels): one `nanoserve up` per GPU (the Qwen3-0.6B shape, dummy weights,
# a KV pool of --num-kv-blocks 256 x 256 tokens each, so the workload competes for it), then
# bench/router_prefix.py through SMG: round robin against cache-aware routing on the multi-tenant prefix
# workload, all requests at once and as Poisson arrivals at 20 requests/s, and what SMG adds to the
# batch-1 TTFT. Results under $OUT (default bench/out). About 5 minutes.
#   bench/gpu_routers.sh
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
model=.cache/qwen3-0.6b-dummy
python3 -m nanoserve_cli.demo_model "$model" --shape qwen3-0.6b --no-weights >/dev/null
pids=()
replicas=()
for gpu in 0 1; do
  CUDA_VISIBLE_DEVICES=$gpu python3 -m nanoserve_cli up --model "$model" --load-format dummy \
    --attention-backend triton --num-kv-blocks 256 --port $((50051 + gpu)) --worker-base-port $((50161 + 10 * gpu)) \
    --openai-port $((8001 + gpu)) > "$out/routers_replica$gpu.log" 2>&1 &
  pids+=($!)
  replicas+=("http://127.0.0.1:$((8001 + gpu))=127.0.0.1:$((50051 + gpu))")
done
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT
for gpu in 0 1; do
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$((8001 + gpu))/health" >/dev/null && break
    kill -0 "${pids[$gpu]}" 2>/dev/null || { tail -20 "$out/routers_replica$gpu.log"; exit 1; }
    sleep 1
  done
done
timeout 200 python3 bench/router_prefix.py --replicas "${replicas[@]}" --log "$out/routers_smg.log" \
  --out "$out/router_prefix_burst.json" 2>&1 | tee "$out/router_prefix_burst.log"
timeout 150 python3 bench/router_prefix.py --replicas "${replicas[@]}" --request-rate 20 --overhead-requests 0 \
  --seed 100 --log "$out/routers_smg.log" --out "$out/router_prefix_rate20.json" 2>&1 | tee "$out/router_prefix_rate20.log"
