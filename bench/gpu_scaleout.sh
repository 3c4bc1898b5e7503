#!/usr/bin/env bash
# Scale-out on a lent multi-GPU machine (2 or 4 H100s; CUDA_VISIBLE_DEVICES narrows it to some of them),
# from the repo root, in under 9 minutes:
#   bench/gpu_scaleout.sh [all|dp|ttft|tenants|router|client]   (results under $OUT, default bench/out/scaleout:
#                                     JSON per run, summary.json and summary.md from bench/scaleout_summary.py)
# Every run goes through the OpenAI port (bench/serve.py --openai, prompts as text for SMG):
#   1. the throughput workload (docs/benchmarks.md) on one replica direct (its gateway), then on N replicas (N = the
#      GPUs) through SMG with N x the requests: the ratio to N x one replica (target >= 0.95); then the same
#      through SMG's own launcher (its accept queue at 128 where up's holds 4096) and through up's with round
#      robin, and bench/burst_arrival.py's connection bursts down each path; each run keeps the kernel's
#      accept-queue drops and SYN retries around it;
#   2. the router's added TTFT at low load (bench/router_overhead.py): 150 rounds of one request at a time
#      straight to replica 0, straight to the replicas in turn, and through SMG, every request a prompt of
#      its own, on the N-replica server of part 1; then SMG's own cost on this host's CPU, in front of
#      minimal HTTP backends that answer at once;
#   3. the multi-tenant prefix workload (long shared system prompts, several users asking round after
#      round, sized to ~70% of the replicas' combined KV): SMG round robin against cache-aware, at a Poisson
#      rate between the two policies' capacities and at saturation;
#   4. DP2 through SMG against TP2 direct, on the 0.6B and the 8B shapes (random weights, dummy load).
# dp: part 1 only; ttft: part 2 only (with its server); tenants: part 3 only; router: parts 2 and 3; client: bench/client_ceiling.py alone
# (~4 minutes on two GPUs); each then the summary.
# Every run through SMG also records how many requests each replica finished (bench/serve.py --replicas).
# The throughput runs (1 and 4) send from `clients` (2) client processes per GPU on both sides of each
# comparison (bench/serve.py --client-processes): one Python client spends ~15-20 us of CPU a streamed
# event, so two replicas' ~35k events/s nearly filled its core; each run's JSON records every client
# process's CPU share (client.cpu_per_wall), and the summary the busiest one's; bench/client_ceiling.py
# measures what 1 and 2 client processes take on this host (client_ceiling/ceiling.json; part 5).
# A part that would not end in time is skipped (the summary says what is missing).
# Carried wheels in .whl/ (smg, setproctitle, fastapi and its needs, uvicorn, grpcio-health-checking,
# grpcio-reflection, ...: docs/scale-out.md lists them) are installed first.
set -uo pipefail
declare -A parts=([all]="1 2 3 4 5" [dp]="1" [ttft]="2" [tenants]="3" [router]="2 3" [client]="5")
mode=${1:-all}
[ -n "${parts[$mode]:-}" ] || { echo "usage: $0 [all|dp|ttft|tenants|router|client]"; exit 2; }
part() { [[ " ${parts[$mode]} " == *" $1 "* ]]; }  # whether this mode runs part $1
source bench/gpu_env.sh
out=$out/scaleout; mkdir -p "$out"
started=$SECONDS
# the GPUs CUDA_VISIBLE_DEVICES names (the launcher gives replicas those), else every GPU of the host
gpus=$(if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
       else nvidia-smi --query-gpu=index --format=csv,noheader | wc -l; fi)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
small=.cache/qwen3-0.6b-shape big=.cache/qwen3-8b-shape
python3 -m nanoserve_cli.demo_model "$small" --shape qwen3-0.6b --no-weights >/dev/null
python3 -m nanoserve_cli.demo_model "$big" --shape qwen3-8b --no-weights >/dev/null
# the replicas' gRPC ports from here up (a lent host once had a service of its own on 50052)
grpc_port=43051
ss -ltn 2>/dev/null | awk 'NR > 1 {print $4}' | sort > "$out/listening_before.txt"
common=(--load-format dummy --attention-backend triton --max-model-len 4096 --shutdown-timeout 5
        --port $grpc_port --worker-base-port $((grpc_port + 10)) --openai-port 8000)
url=http://127.0.0.1:8000
design=(--request-rates inf --input-len 100 1024 --output-len 100 1024 --temperature 0.6)
clients=2  # client processes per GPU in the throughput runs

up() {  # name, then `nanoserve up` flags: starts it and waits until it serves (or gives up)
  local name=$1; shift
  for attempt in 1 2 3 4 5; do  # a port still held by the last run's closing connections: again shortly
    python3 -m nanoserve_cli up "${common[@]}" "$@" > "$out/$name.server.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
      grep -q "nanoserve is serving" "$out/$name.server.log" && return 0
      kill -0 $server 2>/dev/null || break
      sleep 0.5
    done
    grep -q "the port is in use" "$out/$name.server.log" || break
    sleep 3
  done
  echo "$name: the server did not start:"; tail -5 "$out/$name.server.log"; down; return 1
}
down() {
  kill -INT $server 2>/dev/null
  for _ in $(seq 120); do kill -0 $server 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL $server 2>/dev/null
}
bench() {  # name, model, then bench/serve.py flags; through ${via:-$url}, the kernel's TCP counters around it
  local name=$1 model=$2; shift 2
  tcp_counters > "$out/$name.tcp_before.txt"
  timeout 150 python3 bench/serve.py --openai "${via:-$url}" --text-prompts "$model" --warmup 8 "$@" \
    --out "$out/$name.json" 2>&1 | grep -v " INFO " | tail -4
  tcp_counters > "$out/$name.tcp_after.txt"
}
tcp_counters() {  # connections the kernel dropped from a full accept queue, and SYNs sent again (a drop's retry)
  awk '/^TcpExt:/ { if (!seen++) { for (i = 2; i <= NF; i++) name[i] = $i } else for (i = 2; i <= NF; i++)
       if (name[i] ~ /^(ListenOverflows|ListenDrops|TCPSynRetrans)$/) print name[i], $i }' /proc/net/netstat
}
gateways() {  # the gateways of `up --data-parallel-size $1`: replica d's is on 8001 + d
  for d in $(seq 0 $(($1 - 1))); do echo "http://127.0.0.1:$((8001 + d))"; done
}
replicas() {  # the schedulers of `up --data-parallel-size $1`: replica d's gRPC port is --port + d
  for d in $(seq 0 $(($1 - 1))); do echo "127.0.0.1:$((grpc_port + d))"; done
}
in_time() { (( SECONDS - started < ${1:-480} )) || { echo "skipped (time): $2"; return 1; }; }

# 1 and 2: one replica direct, then every GPU a replica behind SMG
if part 1; then
  up dp1_small --model "$small" && { bench dp1_small "$small" "${design[@]}" --num-prompts 256 \
    --client-processes $clients; down; }
fi
if { part 1 || part 2; } && up "dp${gpus}_small" --model "$small" --data-parallel-size "$gpus"; then
  part 1 && bench "dp${gpus}_small" "$small" "${design[@]}" --num-prompts $((256 * gpus)) \
    --replicas $(replicas "$gpus") --client-processes $((clients * gpus))
  # the same prompts to the same replicas with no router: client process i drives replica i mod N's gateway,
  # so that what the router path costs shows apart from what N replicas on one host cost
  part 1 && via=$(gateways "$gpus" | paste -sd,) bench "dp${gpus}_small_direct" "$small" "${design[@]}" \
    --num-prompts $((256 * gpus)) --replicas $(replicas "$gpus") --client-processes $((clients * gpus))
  if part 1; then
    # what up's router queues (its launcher's line) and the most this host lets any port queue
    { grep -h "accept queue" "$out/dp${gpus}_small.server.log"
      echo "net.core.somaxconn $(cat /proc/sys/net/core/somaxconn)"; } | tee "$out/accept_queue.txt"
    # Two more routers in front of the same replicas, each for a run like up's on fresh prompts (--seed 1, 2):
    # SMG's own launcher (its port's accept queue at 128, where up's holds 4096: nanoserve_cli/smg_router.py),
    # the baseline; and up's launcher with round robin, so a loss left over shows whether the policy has a
    # part in it. Then bench/burst_arrival.py's bursts of connections opened at once, straight to replica 0
    # and through both launchers, with the arrivals read from the schedulers' lines in the server log.
    for variant in "smg_own 8100 own cache_aware 1" "rr 8101 up round_robin 2"; do
      read -r name port launcher policy seed <<< "$variant"
      python3 bench/burst_arrival.py --gateways $(gateways "$gpus") --serve-router "$port" --launcher "$launcher" \
        --policy "$policy" --out "$out/router_$name.json" > "$out/router_$name.log" 2>&1 &
      router=$!
      for _ in $(seq 120); do grep -q "routes on port" "$out/router_$name.log" && break; sleep 0.5; done
      via=http://127.0.0.1:$port bench "dp${gpus}_small_$name" "$small" "${design[@]}" \
        --num-prompts $((256 * gpus)) --replicas $(replicas "$gpus") --client-processes $((clients * gpus)) --seed "$seed"
      kill -TERM $router; wait $router
    done
    in_time 400 "the connection bursts" && timeout 150 python3 bench/burst_arrival.py --gateways $(gateways "$gpus") \
      --scheduler-logs "$out/dp${gpus}_small.server.log" --tokenizer "$small" --connections 256 \
      --out "$out/burst_arrival.json" 2>&1 | grep -v " INFO " | tail -8
  fi
  if part 2; then
    timeout 120 python3 bench/router_overhead.py --gateways $(gateways "$gpus") --router "$url" --tokenizer "$small" \
      --requests 150 --prompt-tokens 512 --output-tokens 16 --out "$out/router_overhead.json" 2>&1 \
      | grep -v " INFO " | tail -3
  fi
  down
fi
if part 5; then
  # what one client process takes against a paced SSE server (no GPU): the messages a second and their CPU price
  timeout 120 python3 bench/client_ceiling.py --out "$out/client_ceiling/ceiling.json" 2>&1 | tail -4
fi
if part 2; then  # SMG's own cost: in front of backends that answer at once, then after 10 ms (a prefill's wait)
  timeout 120 python3 bench/router_overhead.py --backend echo --replicas "$gpus" --requests 150 --prompt-tokens 16 512 \
    4096 --policies cache_aware round_robin --log "$out/router_overhead_echo.smg.log" \
    --out "$out/router_overhead_echo.json" 2>&1 | tail -7
  timeout 60 python3 bench/router_overhead.py --backend echo --echo-delay-ms 10 --replicas "$gpus" --requests 150 \
    --log "$out/router_overhead_echo.smg.log" --out "$out/router_overhead_echo_wait.json" 2>&1 | tail -2
fi
# 3: the tenants at steady state. Their system prompts fill ~70% of the combined KV: 256 blocks of 256
# tokens (65,536 tokens) per replica, 21 tenants of 4,096 tokens on two replicas (as text they re-tokenize
# a little longer: ~17 blocks each, 357 of 512 blocks). Split by tenant (cache-aware) each replica holds
# its 10 or 11 (187 blocks) and its running requests' blocks, with room for an uneven placement (SMG places
# a tenant by load at its first request; on CPU 8 tenants went 5/3): 12 (204 blocks) still fit. Spread
# (round robin) each replica needs all 21 (357 blocks) and thrashes. A prompt is a system prompt and a
# 64-token question (--max-model-len 8192, a later flag wins), 64 output tokens; 8 users a tenant ask 12
# rounds: 2,016 requests.
# Sizing (0.6B shape, one replica prefills ~100k tok/s and decodes ~25k tok/s): a round-robin request
# misses about half its system prompt (hit rate 0.44 measured), ~2,100 prompt tokens, 21 ms of prefill,
# plus ~3 ms of decode: ~40 req/s a replica, 80 on two (measured: 5,061 output tok/s = 79 req/s). A
# cache-aware request prefills ~70 tokens (under 1 ms) and decodes 64 (~3 ms): 250+ req/s a replica.
# Poisson arrivals at 100 req/s a replica (200 on two) sit between, above 1.6 x round robin's capacity
# (measured 97 req/s on two H200s): its queue grows by ~100 req/s for the ~10 s of arrivals (TTFT p90
# in seconds) while cache-aware's stays near empty; this run carries the targets. Then all at once (inf),
# on the same tenants with new questions: a burst, reported beside it. Before both, each tenant asks once
# (bench/serve.py's warm-up): the timed runs see the steady state, not every prompt's first prefill. Time on two GPUs: round robin
# ~21 s + ~21 s, cache-aware ~10 s + ~8 s, plus ~25 s start and stop per policy: ~2.5 minutes.
# After each policy, SMG's metrics (its cache-aware branches, overload fallbacks) are kept beside it.
tenants=$(( gpus * 256 * 256 * 70 / 100 / (4096 + 64) ))
part 3 && in_time 300 "the tenants' runs" && for policy in round_robin cache_aware; do
  up "tenants_$policy" --model "$small" --data-parallel-size "$gpus" --max-model-len 8192 \
    --router-policy "$policy" --num-kv-blocks 256 && {
      bench "tenants_$policy" "$small" --tenants "$tenants" --users 8 --rounds 12 --system-len 4096 \
        --input-len 64 64 --output-len 64 64 --request-rates $((100 * gpus)) inf --temperature 0.6 \
        --replicas $(replicas "$gpus")
      python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
        "http://127.0.0.1:$((8001 + gpus))/metrics" | grep -E "^smg_(cache_aware|worker_overload|workers_over)" \
        > "$out/tenants_$policy.smg_metrics.txt"
      down; }
done
# 4: DP2 against TP2 on each shape, both runs or neither; the 8B first (with two GPUs the 0.6B DP2 run
# is the N-replica one above, so the 0.6B pair needs one run more)
part 4 && for shape in big small; do
  model=${!shape} reuse=$([ "$shape" = small ] && [ "$gpus" = 2 ] && echo yes)
  in_time $([ "$shape" = big ] && echo 375 || { [ -n "$reuse" ] && echo 470 || echo 420; }) "DP2 against TP2 ($shape)" \
    || continue
  if [ -z "$reuse" ] && up "dp2_$shape" --model "$model" --data-parallel-size 2; then
    bench "dp2_$shape" "$model" "${design[@]}" --num-prompts 512 --replicas $(replicas 2) \
      --client-processes $((clients * 2)); down
  fi
  up "tp2_$shape" --model "$model" --tensor-parallel-size 2 \
    && { bench "tp2_$shape" "$model" "${design[@]}" --num-prompts 512 --client-processes $((clients * 2)); down; }
done
python3 bench/scaleout_summary.py "$out" "$gpus"
echo "done in $((SECONDS - started)) s"
