#!/usr/bin/env bash
# On a lent GPU machine, from the repo root (issue 40, one call of under 8 minutes): the grammar-mask
# kernel against its reference on CUDA, the structured-output service tests on CUDA, then
# bench/grammar.py on the 0.6B and 8B shapes (dummy weights): DESIGN throughput with every request
# JSON-schema constrained against none, batch-1 ITL with and without, first-use compile of a typical
# schema, invalid outputs among constrained ones that stopped; then bench/grammar_host.py on the 0.6B shape:
# the launcher thread's grammar time per prefill/mixed and decode step (256 constrained sequences arriving). Wheels the image lacks (llguidance,
# jsonschema and its needs) come from .whl/. Results under $OUT (default bench/out).
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import llguidance, jsonschema; print('llguidance', llguidance.__version__)" || exit 1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k token_bitmask 2>&1 \
  | tee "$out/grammar_kernel.log" | tail -3
NANOSERVE_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/services/test_structured_outputs.py -k "not killed" 2>&1 | tee "$out/grammar_service_tests.log" | tail -3
for shape in qwen3-0.6b qwen3-8b; do
  python3 -m nanoserve_cli.demo_model ".cache/$shape-dummy" --shape "$shape" --no-weights >/dev/null
  timeout 150 python3 bench/grammar.py --model ".cache/$shape-dummy" \
    --extra "--load-format dummy --attention-backend triton" --out "$out/grammar_$shape.json" 2>&1 \
    | grep -v " INFO " | tee "$out/grammar_$shape.log" | tail -40
done
timeout 120 python3 bench/grammar_host.py --model .cache/qwen3-0.6b-dummy --device cuda --load-format dummy \
  --attention-backend triton --decode-steps 32 --out "$out/grammar_host.json" 2>&1 | grep -v " INFO " \
  | tee "$out/grammar_host.log" | tail -40
