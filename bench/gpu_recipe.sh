#!/usr/bin/env bash
# Follows the README's "A real model on your GPU" recipe on a GPU machine, from a clean virtual
# environment, and prints every command it runs with what it printed. Results under $OUT (default
# bench/out): recipe.log (all of it), up.log (the launcher's and services' lines), info.json.
#   bench/gpu_recipe.sh
# Offline variant of the recipe's two pip steps: the machine has no network, so the venv reuses the
# image's torch 2.11.0 (CUDA 13) through --system-site-packages in place of `pip install -r
# docker/requirements-worker.txt`, and `pip install ".[worker,gateway]"` takes the packages the image
# lacks (FastAPI, uvicorn, the gRPC health and reflection services, ...) from .whl/ with
# --no-index --find-links. The model is the Qwen3-0.6B shape with random bf16 weights, built here
# (.cache/tokenizer-qwen3 must be there: nothing can be fetched), in place of a Hub id.
set -uo pipefail
out=${OUT:-bench/out}; mkdir -p "$out"
exec > >(tee "$out/recipe.log") 2>&1
export NANOSERVE_CACHE=$PWD/.cache PYTHONUNBUFFERED=1
venv=/tmp/nanoserve-recipe
model=$NANOSERVE_CACHE/qwen3-0.6b-random
run() { echo "+ $*"; "$@"; }

# The image keeps torch in a virtual environment of its own, which --system-site-packages does not
# reach (that flag gives the base interpreter's packages): a .pth file puts its site folder on the new
# venv's path, so pip counts what is there (torch, grpcio, ...) as installed.
image_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') || exit 1
run python3 -m venv --system-site-packages "$venv" || exit 1
. "$venv/bin/activate"
echo "$image_site" > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-image.pth"
run python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
run pip install -q --no-index --find-links .whl --no-build-isolation ".[worker,gateway]" || exit 1
run python -m nanoserve_cli.demo_model "$model" --shape qwen3-0.6b || exit 1
cd /tmp  # from here on the installed package serves, not the checkout
echo "+ nanoserve up --model $model --openai-port 8000 &"
nanoserve up --model "$model" --openai-port 8000 > "$out/up.log" 2>&1 &
up=$!
for _ in $(seq 300); do
  grep -q "nanoserve is serving" "$out/up.log" && break
  kill -0 $up 2>/dev/null || break
  sleep 1
done
grep -E "runs on|nanoserve is serving|attention|nanoserve up" "$out/up.log"
run nanoserve info | tee "$out/info.json"
echo "+ curl localhost:8000/v1/completions ..."
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"prompt": "Tell me about the sea.", "max_tokens": 16, "temperature": 0}'
echo
run nanoserve generate "Tell me about the sea." --max-tokens 16
echo "+ kill -TERM (as Ctrl-C) nanoserve up"  # a script's background job ignores SIGINT
kill -TERM $up
wait $up
echo "nanoserve up exited with $?"
