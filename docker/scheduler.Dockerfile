# syntax=docker/dockerfile:1
# nanoserve scheduler: the public nanoserve.v1.LLM API on CPU. No torch, no CUDA: only gRPC,
# protobuf, xxhash, tokenizers, prometheus-client and jinja2 (chat templates), the contract
# package, the scheduler and the `nanoserve` CLI (which runs the scheduler as `python -m scheduler_svc`).
#   docker build -f docker/scheduler.Dockerfile -t nanoserve-scheduler .

FROM python:3.12-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --system --create-home --uid 10001 nanoserve
WORKDIR /app

# Dependencies before code, so a code change rebuilds only the last layers.
COPY docker/requirements-scheduler.txt docker/
RUN pip install --no-cache-dir -r docker/requirements-scheduler.txt

COPY pyproject.toml ./
COPY proto/ proto/
COPY scheduler_svc/ scheduler_svc/
COPY nanoserve_cli/ nanoserve_cli/
# Build-time check: the scheduler, the CLI and the probe import and start here, where torch is absent.
RUN pip install --no-cache-dir --no-deps . \
 && pip check \
 && python -c "import scheduler_svc.server, nanoserve.healthcheck, nanoserve_cli.cli" \
 && python -c "import importlib.util; assert not importlib.util.find_spec('torch'), 'torch is here'" \
 && nanoserve scheduler --help > /dev/null \
 && python -m scheduler_svc --help > /dev/null

USER 10001
EXPOSE 50051
ENTRYPOINT ["nanoserve"]
CMD ["scheduler"]
