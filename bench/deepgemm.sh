#!/usr/bin/env bash
# DeepGEMM (github.com/deepseek-ai/DeepGEMM, MIT) for the FP8 weights' decode GEMMs
# (nanoserve_kernels/deepgemm_fp8.py): its Python package with the CUDA headers it compiles at first use (its
# own and CUTLASS's), and the CUDA Python bindings it drives the GPU with.
#
#   fetch DIR     (a machine with network and git): DIR/deep_gemm.tar.xz, DeepGEMM at $COMMIT (the last release
#                 whose compiler is driven from Python, no C++ extension to build) with CUTLASS's headers, and
#                 the cuda-bindings wheels for CUDA $CUDA_MAJOR (the driver's) and Python $PYTHON
#   install DIR   (the GPU machine, with nvcc; DIR carried along): unpacks into DIR/pkg, with the bindings'
#                 wheels where the image lacks them; then `export PYTHONPATH=DIR/pkg:$PYTHONPATH`
#
# Keep DIR out of git (list it in .git/info/exclude) and name it in a device call's carry; bench/gpu_env.sh
# installs .dg/ when it is there.
set -euo pipefail
COMMIT=8dfa3298274bfe6b242f6f8a3e6f3eff2707dd9f CUDA_MAJOR=${CUDA_MAJOR:-13} PYTHON=${PYTHON:-3.12}
DEEPGEMM_REPO=${DEEPGEMM_REPO:-https://github.com/deepseek-ai/DeepGEMM}  # or a local mirror of each
CUTLASS_REPO=${CUTLASS_REPO:-https://github.com/NVIDIA/cutlass}
mode=${1:?fetch|install} dir=$(readlink -f "${2:?DIR}")
mkdir -p "$dir"
case $mode in
fetch)
  work=$(mktemp -d)
  git clone -q "$DEEPGEMM_REPO" "$work/src"
  git -C "$work/src" checkout -q "$COMMIT"
  # CUTLASS at DeepGEMM's submodule commit: its two header trees only, the rest of its blobs left on the server
  git clone -q --filter=blob:none --no-checkout "$CUTLASS_REPO" "$work/cutlass"
  git -C "$work/cutlass" sparse-checkout set include/cute include/cutlass
  git -C "$work/cutlass" checkout -q "$(git -C "$work/src" rev-parse HEAD:third-party/cutlass)"
  cp -r "$work/cutlass/include/cute" "$work/cutlass/include/cutlass" "$work/src/deep_gemm/include/"
  tar cJf "$dir/deep_gemm.tar.xz" -C "$work/src" deep_gemm LICENSE
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON" \
    --platform manylinux_2_28_x86_64 -d "$dir" "cuda-bindings==$CUDA_MAJOR.*" cuda-pathfinder
  rm -rf "$work"
  ls -la "$dir" ;;
install)
  [ -e "$dir/pkg/.installed" ] && exit 0
  command -v nvcc >/dev/null || ls /usr/local/cuda*/bin/nvcc >/dev/null || { echo "DeepGEMM needs nvcc"; exit 1; }
  mkdir -p "$dir/pkg" && tar xJf "$dir/deep_gemm.tar.xz" -C "$dir/pkg"
  python3 -c "import cuda.bindings.driver" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$dir/pkg" "$dir"/*.whl
  touch "$dir/pkg/.installed" ;;
*) echo "fetch|install"; exit 1 ;;
esac
