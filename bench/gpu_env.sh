# Sourced by the GPU scripts (bench/gpu_*.sh), from the repo root: results under $OUT (default
# bench/out) as $out, the repo on the path, the wheels the GPU image lacks (health, reflection), and DeepGEMM
# where .dg/ holds it (bench/deepgemm.sh fetch .dg).
set -uo pipefail
out=${OUT:-bench/out}; mkdir -p "$out"
export PYTHONPATH=$PWD:$PWD/proto PYTHONUNBUFFERED=1 NANOSERVE_CACHE=$PWD/.cache
if ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine: scripts run side by side (one per GPU) must not install over each other
  [ -e /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -e .dg/deep_gemm.tar.xz ]; then
  command -v nvcc >/dev/null || export PATH=$PATH:$(dirname "$(ls /usr/local/cuda*/bin/nvcc | head -1)")
  bash bench/deepgemm.sh install .dg && export PYTHONPATH=$PYTHONPATH:$PWD/.dg/pkg
fi
