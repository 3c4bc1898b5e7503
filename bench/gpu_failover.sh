#!/usr/bin/env bash
# On a lent machine with two GPUs (nvidia-h100-x2), from the repo root, about 5 minutes:
# 1. a tensor-parallel group of two ranks (NCCL), each with an address of its own, rank 1 SIGKILLed
#    mid-stream and restarted alone: every greedy and seeded stream must end with the tokens of an
#    undisturbed run (tests/gpu/test_failover_gpu.py; $OUT/gpu_failover.json has both runs' tokens and
#    how long the scheduler waited for the group);
# 2. two replicas of the 0.6B shape (random weights), one per GPU, at 8 requests/s while a whole replica
#    is SIGKILLed every 30 s and started again; the clients fail over (bench/chaos.py --kill replica):
#    failed requests (target 0), recovery and extra latency per affected request, $OUT/chaos_replica.json.
source bench/gpu_env.sh
export OUT=$out
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_failover_gpu.py 2>&1 \
  | tee "$out/gpu_failover.log" | grep -E "^failover:|passed|failed|skipped|Error" | tail -8
model=.cache/qwen3-0.6b-random
[ -f $model/config.json ] || python3 -m nanoserve_cli.demo_model $model --shape qwen3-0.6b >/dev/null
timeout 180 python3 bench/chaos.py --model $model --replicas 2 --replica-gpus 0 1 --kill replica --rate 8 \
  --kills 2 --kill-every 30 --extra "--attention-backend triton --max-model-len 4096" \
  --out "$out/chaos_replica.json" 2>&1 | grep -v -E " INFO |cannot take the request|broke \(" | tail -4
