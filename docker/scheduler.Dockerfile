# syntax=docker/dockerfile:1
# nanoserve scheduler and gateway: the public nanoserve.v1.LLM API and the OpenAI-compatible HTTP
# gateway in front of it, both on CPU. No torch, no CUDA: only gRPC, protobuf, xxhash, tokenizers,
# prometheus-client, huggingface_hub (the tokenizer of a Hub id), Jinja2 (chat templates) and
# the gateway's FastAPI/uvicorn, the contract package, the two services
# and the `nanoserve` CLI (which runs them as `python -m scheduler_svc` / `python -m gateway_svc`).
# One image for both: they are CPU services of the same small dependency set, so one build and one
# set of pins serve both; the gateway's packages add ~20 MB to a ~170 MB image.
#   docker build -f docker/scheduler.Dockerfile -t nanoserve-scheduler .

FROM python:3.12-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# /models: where compose mounts the model volume (read-only here); a fresh named volume takes this owner.
RUN useradd --system --create-home --uid 10001 nanoserve \
 && install -d -o nanoserve -g nanoserve /models
WORKDIR /app

# Dependencies before code, so a code change rebuilds only the last layers.
COPY docker/requirements-scheduler.txt docker/
RUN pip install --no-cache-dir -r docker/requirements-scheduler.txt

COPY pyproject.toml ./
COPY proto/ proto/
COPY scheduler_svc/ scheduler_svc/
COPY gateway_svc/ gateway_svc/
COPY nanoserve_cli/ nanoserve_cli/
# Build-time check: the scheduler, the gateway, the CLI and both probes import and start here, where
# torch is absent.
RUN pip install --no-cache-dir --no-deps . \
 && pip check \
 && python -c "import scheduler_svc.server, gateway_svc.app, gateway_svc.healthcheck, nanoserve.healthcheck, nanoserve_cli.cli" \
 && python -c "import importlib.util; assert not importlib.util.find_spec('torch'), 'torch is here'" \
 && nanoserve scheduler --help > /dev/null \
 && python -m scheduler_svc --help > /dev/null \
 && nanoserve gateway --help > /dev/null \
 && python -m gateway_svc --help > /dev/null

USER 10001
# 50051: the public gRPC API; 8000: the gateway's HTTP API.
EXPOSE 50051 8000
ENTRYPOINT ["nanoserve"]
CMD ["scheduler"]
