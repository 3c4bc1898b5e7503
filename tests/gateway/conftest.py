"""One worker, one scheduler (serving /metrics) and one gateway, shared by the gateway tests."""
from pathlib import Path

import openai
import pytest

from nanoserve.client import Client
from tests.gateway.gateway_process import running_gateway
from tests.services.processes import free_port, running_service

NUM_KV_BLOCKS = 200
BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def service(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway") / "services.log"
    metrics_port = free_port()
    worker_flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "32")
    with running_service(Path(tiny_model_dir), log, worker_flags=worker_flags,
                         scheduler_flags=("--metrics-port", str(metrics_port))) as svc:
        yield {**svc, "log": log, "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}


@pytest.fixture(scope="session")
def gateway(service) -> str:
    with running_gateway(service["address"], service["log"]) as url:
        yield url


@pytest.fixture(scope="session")
def oai(gateway) -> openai.OpenAI:
    with openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def grpc_client(service) -> Client:
    with Client(service["address"]) as client:
        yield client


@pytest.fixture(scope="session")
def model_name(tiny_model_dir) -> str:
    return Path(tiny_model_dir).name
