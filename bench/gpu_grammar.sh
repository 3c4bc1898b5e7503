#!/usr/bin/env bash
# On a lent GPU machine, from the repo root (issue 40). Wheels the image lacks (llguidance, jsonschema and
# its needs) come from .whl/. Results under $OUT (default bench/out).
#
#   bench/gpu_grammar.sh        (one call of under 8 minutes) the grammar-mask kernel and the race sampler
#                               (masked or not) against their references on CUDA, the structured-output
#                               service tests on CUDA, bench/grammar.py on the 0.6B and 8B shapes (dummy
#                               weights), bench/grammar_gil.py on the host's CPU, then bench/grammar_host.py
#                               on the 0.6B shape;
#   bench/gpu_grammar.sh bench  (under 5 minutes) the kernel tests, bench/grammar.py on both shapes and
#                               bench/grammar_gil.py only;
#   bench/gpu_grammar.sh timeline  (under 2 minutes) bench/step_timeline.py on the 0.6B shape: where a batch-1
#                               step's time goes between the worker's threads, plain and constrained.
# Both end with a summary, two lines a shape: the throughput ratio; rank 0's decode steps (device busy, idle
# before each, host time) and prefill/mixed steps (busy, host); the device's seconds in steps against the
# run's; the mask split (ms a masked step: the matchers' advance after a step, on the step's reply thread:
# tokens wait, consume, fill and the rows' copy; first masks, on the mask thread; the launcher: wait, then
# the mask kernel where processors or logprobs follow); batch-1 ITL with its split,
# first use and invalid outputs. Then one line from bench/grammar_gil.py on this host's CPU: a launcher-bound
# batch-1 stand-in's step, plain, and constrained with the matchers advanced by the reply thread (the
# worker's way), by the launcher, or by a mask thread of their own.
#
# bench/grammar.py: DESIGN throughput with every request JSON-schema constrained against none, batch-1 ITL
# with and without, first-use compile of a typical schema, invalid outputs among constrained ones that
# stopped; each server's log beside its JSON (grammar_<shape>.server.log).
source bench/gpu_env.sh
mode=${1:-all}
if [ "$mode" = timeline ]; then
  python3 -m nanoserve_cli.demo_model .cache/qwen3-0.6b-dummy --shape qwen3-0.6b --no-weights >/dev/null
  timeout 110 python3 bench/step_timeline.py --model .cache/qwen3-0.6b-dummy --rounds 12 \
    --extra "--load-format dummy --attention-backend triton" --out "$out/step_timeline.json" | tail -40
  exit
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import llguidance, jsonschema; print('llguidance', llguidance.__version__)" || exit 1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "token_bitmask or sampling" 2>&1 \
  | tee "$out/grammar_kernel.log" | tail -3
if [ "$mode" = all ]; then
  NANOSERVE_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider \
    tests/services/test_structured_outputs.py -k "not killed" 2>&1 | tee "$out/grammar_service_tests.log" | tail -3
fi
for shape in qwen3-0.6b qwen3-8b; do
  python3 -m nanoserve_cli.demo_model ".cache/$shape-dummy" --shape "$shape" --no-weights >/dev/null
  limit=$([ "$shape" = qwen3-8b ] && echo 150 || echo 110)
  timeout "$limit" python3 bench/grammar.py --model ".cache/$shape-dummy" \
    --extra "--load-format dummy --attention-backend triton" --out "$out/grammar_$shape.json" 2>&1 \
    | tee "$out/grammar_$shape.log" | tail -$([ "$mode" = all ] && echo 40 || echo 3)
done
# this host's CPU: what a constraint adds to a launcher-bound batch-1 step, by which thread advances the matchers
timeout 60 python3 bench/grammar_gil.py --tokenizer .cache/qwen3-0.6b-dummy/tokenizer.json \
  --out "$out/grammar_gil.json" > "$out/grammar_gil.log" 2>&1
if [ "$mode" = all ]; then
  timeout 120 python3 bench/grammar_host.py --model .cache/qwen3-0.6b-dummy --device cuda --load-format dummy \
    --attention-backend triton --decode-steps 32 --out "$out/grammar_host.json" 2>&1 | grep -v " INFO " \
    | tee "$out/grammar_host.log" | tail -40
fi
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path

def split(parts: dict) -> str:
    names = ("tokens_wait", "consume", "fill", "first", "launcher_wait", "queue")
    return " ".join(f"{name} {parts[name]:.2f}" for name in names if name in parts) or "(none logged)"

for shape in ("qwen3-0.6b", "qwen3-8b"):
    path = Path(sys.argv[1]) / f"grammar_{shape}.json"
    if not path.exists():
        print(f"{shape}: no result (see grammar_{shape}.log)")
        continue
    r = json.loads(path.read_text())
    plain, constrained = r["plain"], r["json_schema"]
    step = lambda run: "/".join(f"{run[f'decode_{name}_ms']:.2f}" for name in ("busy", "idle", "host"))
    prefill = lambda run: f"{run['prefill_steps']} x {run['prefill_busy_ms']:.1f}/{run['prefill_host_ms']:.1f}"
    device = lambda run: f"{run['device_seconds']:.2f} of {run['seconds']:.2f}"
    cached = lambda run: f"{run.get('prefix_hit_tokens', 0):,} of {run.get('prompt_tokens', 0):,}"
    print(f"{shape}: throughput {plain['tok_per_s']:,.0f} -> {constrained['tok_per_s']:,.0f} tok/s, ratio "
          f"{r['throughput_ratio']:.3f} (target 0.9); decode steps {plain['decode_steps']} -> "
          f"{constrained['decode_steps']}, busy/idle/host ms {step(plain)} -> {step(constrained)}; prefill/mixed "
          f"steps x busy/host ms {prefill(plain)} -> {prefill(constrained)}; device s in steps {device(plain)} -> "
          f"{device(constrained)}; prompt tokens from the prefix cache {cached(plain)} -> {cached(constrained)}; "
          f"mask split ms a masked step: {split(constrained.get('mask_split', {}))}")
    itl = r["itl_batch1_ms"]
    print(f"{shape}: batch-1 ITL {itl['plain']:.3f} -> {itl['json_schema']:.3f} ms, {100 * (r['itl_ratio'] - 1):+.1f}% "
          f"(target +5%); mask split ms a step: {split(r.get('itl_mask_split', {}))}; first use p50 "
          f"{r['first_use_compile']['total_p50_ms']:.1f} ms; invalid {constrained['invalid_among_stopped']} of "
          f"{constrained['stopped']} stopped")
path = Path(sys.argv[1]) / "grammar_gil.json"
if path.exists():
    gil = json.loads(path.read_text())
    print("host CPU, launcher-bound batch-1 stand-in (bench/grammar_gil.py), step ms: " + ", ".join(
        f"{mode} {ms:.3f}" + (f" ({gil['added_percent'][mode]:+.1f}%)" if mode != "plain" else "")
        for mode, ms in gil["step_ms"].items()))
EOF
