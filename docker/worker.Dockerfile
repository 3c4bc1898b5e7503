# syntax=docker/dockerfile:1
# nanoserve worker: one tensor-parallel rank on one GPU (torch, triton, the model code).
#   docker build -f docker/worker.Dockerfile -t nanoserve-worker .
# The host needs an NVIDIA driver of the R580 series or newer: the base image is CUDA 13.0 and
# torch 2.11's PyPI wheels are built for CUDA 13 (the container toolkit refuses older drivers).
# Attention runs on nanoserve's Triton kernels by default. FLASH_ATTN=yes adds flash-attn, which
# has no wheel on PyPI: a stage of its own compiles one from the pinned sdist for the GPU
# architectures in FLASH_ATTN_CUDA_ARCHS (90 = H100/H200; "80;90" adds A100). That takes tens of
# minutes once (the layer cache keeps it until the torch pin changes); with FLASH_ATTN=no, the
# default, that stage is never built.

ARG CUDA_VERSION=13.0.2
ARG FLASH_ATTN=no

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS flash-attn-yes
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_CUDA_ARCHS=90
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12-dev python3.12-venv g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Built against the same torch the runtime stage installs, with the build tools flash-attn imports.
COPY docker/requirements-worker.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/requirements-worker.txt \
      ninja==1.13.2 packaging==26.3 psutil==7.2.2 setuptools==84.2.1 wheel==0.48.0
# FORCE_BUILD: compile here instead of trying to download a prebuilt wheel from GitHub. A RUN of
# its own, so a failed or re-run compile reuses the torch layer above.
# hadolint ignore=DL3059
RUN FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels \
      "flash-attn==${FLASH_ATTN_VERSION}"

FROM scratch AS flash-attn-no
WORKDIR /wheels

# The stage FLASH_ATTN names (BuildKit builds only the stages the image uses).
# hadolint ignore=DL3006
FROM flash-attn-${FLASH_ATTN} AS flash-attn

FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04
ARG FLASH_ATTN
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Triton and torch.compile build small launchers at run time: they need a C compiler and Python.h.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12-dev python3.12-venv g++ \
 && rm -rf /var/lib/apt/lists/*
# /models: where compose mounts the model volume; a fresh named volume takes this owner, so the
# download service (this image, user 10001) can write to it.
RUN python3.12 -m venv /opt/venv \
 && useradd --system --create-home --uid 10001 nanoserve \
 && install -d -o nanoserve -g nanoserve /models
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app

# Dependencies before code, slowest-changing first, so a code change rebuilds only the last layers.
COPY docker/requirements-worker.txt docker/
RUN pip install --no-cache-dir -r docker/requirements-worker.txt
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt
RUN --mount=type=bind,from=flash-attn,source=/wheels,target=/wheels \
    if [ "${FLASH_ATTN}" = yes ]; then pip install --no-cache-dir --no-deps /wheels/*.whl; fi

COPY pyproject.toml ./
COPY proto/ proto/
COPY nanoserve_kernels/ nanoserve_kernels/
COPY nanoserve_model/ nanoserve_model/
COPY worker_svc/ worker_svc/
COPY nanoserve_cli/ nanoserve_cli/
# Build-time check: consistent dependencies, the worker, the CLI and the probe import, flash-attn is
# there exactly when asked for (found, not imported: the build has no GPU driver), and the `hf`
# command of the compose download service runs.
RUN pip install --no-cache-dir --no-deps . \
 && pip check \
 && python -c "import torch, triton, worker_svc.server, nanoserve.healthcheck, nanoserve_cli.cli" \
 && python -c "import importlib.util as u, sys; assert bool(u.find_spec('flash_attn')) == (sys.argv[1] == 'yes'), \
      'flash-attn is not as FLASH_ATTN=' + sys.argv[1] + ' asks'" "${FLASH_ATTN}" \
 && hf download --help > /dev/null \
 && nanoserve worker --help > /dev/null \
 && python -m worker_svc --help > /dev/null

USER 10001
# 50061: the Worker gRPC service; 29500: where the ranks meet (rank 0's torch.distributed store).
EXPOSE 50061 29500
ENTRYPOINT ["nanoserve"]
CMD ["worker"]
