#!/usr/bin/env bash
# On one GPU, from the repo root, under 3 minutes: where a worker restart's time goes (issue 37).
# `nanoserve up` serves the 0.6B shape (random weights) at 8 requests/s while its rank is SIGKILLed
# (bench/chaos.py), twice: with fresh processes (one kill after 30 s, as the 13.6 s figure in
# bench/RESULTS.md was taken), then with --standby-workers (a kill every 20 s: a group that served
# 10 s restarts without back-off). For each kill it prints the recovery (kill to the next token) and
# its split: detected by the scheduler; rank started (process created, or standby told to go); the
# rank's start-up phases; group back; first token (bench/restart_split.py, docs/recovery-time.md);
# then every start-up line, and how many kernels compiled while serving (the warm-up missed them).
# $OUT/restart_{fresh,standby}.json and their logs.
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
model=.cache/qwen3-0.6b-random
[ -f $model/config.json ] || python3 -m nanoserve_cli.demo_model $model --shape qwen3-0.6b >/dev/null
flags="--load-format dummy --attention-backend triton --max-model-len 4096"
for mode in fresh standby; do
  extra=$flags; kills="--kills 1 --kill-every 30"
  [ $mode = standby ] && extra="$flags --standby-workers" && kills="--kills 2 --kill-every 20"
  echo "== $mode: up $extra; $kills"
  timeout 120 python3 bench/chaos.py --model $model --rate 8 $kills --extra "$extra" \
    --out "$out/restart_$mode.json" 2>&1 | grep -v -E " INFO |cannot take the request" | tail -6
  grep -h "ready in" "$out/restart_${mode}_0.log" | sed 's/^.*nanoserve.worker /  /'
  echo "  kernels compiled while serving: $(grep -c "while serving" "$out/restart_${mode}_0.log")"
done
