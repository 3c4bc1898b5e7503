# syntax=docker/dockerfile:1
# nanoserve router: SMG (the Shepherd Model Gateway) as `nanoserve up --data-parallel-size N` runs it, for
# compose's dp2 profile and the chart. Its entrypoint is nanoserve_cli/smg_router.py: SMG's own launcher
# and flags, its port's accept queue deepened from the 128 connections SMG listens with to 4,096. With 128,
# a burst of 512 new connections lost ~150 SYNs, each to a second's retransmission (docs/scale-out.md).
# Only SMG and that one module, which imports nothing else of nanoserve's: no torch, no services.
#   docker build -f docker/router.Dockerfile -t nanoserve-router .

FROM python:3.12-slim-bookworm
# PYTHONPATH: the one module below is copied into /app, not installed; this finds it from any working directory.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app
RUN useradd --system --create-home --uid 10001 nanoserve
WORKDIR /app

# Dependencies before code, so a code change rebuilds only the last layers.
COPY docker/requirements-router.txt docker/
RUN pip install --no-cache-dir -r docker/requirements-router.txt

COPY nanoserve_cli/__init__.py nanoserve_cli/smg_router.py nanoserve_cli/
# Build-time check: consistent dependencies, the launcher imports and parses SMG's flags, torch is absent.
RUN pip check \
 && python -c "import nanoserve_cli.smg_router" \
 && python -c "import importlib.util; assert not importlib.util.find_spec('torch'), 'torch is here'" \
 && python -m nanoserve_cli.smg_router --help > /dev/null

USER 10001
# SMG's OpenAI API on its default port (--port; compose's dp2 router takes 8000) and the metrics port
# compose and the chart give --prometheus-port.
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "nanoserve_cli.smg_router"]
