"""One replica as a router sees it: a worker, a scheduler and a gateway serving vLLM's metric names,
with room for two running requests so that a third one waits."""
from pathlib import Path

import pytest

from nanoserve.client import Client
from tests.gateway.gateway_process import running_gateway
from tests.services.processes import running_service

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 64
MAX_NUM_SEQS = 2


@pytest.fixture(scope="session")
def replica(tiny_model_dir, tmp_path_factory) -> dict:
    log = tmp_path_factory.mktemp("routers") / "replica.log"
    worker_flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                    "--max-num-seqs", str(MAX_NUM_SEQS))
    with running_service(Path(tiny_model_dir), log, worker_flags=worker_flags) as service:
        with running_gateway(service["address"], log, "--vllm-metric-names") as url:
            yield {**service, "url": url, "log": log}


@pytest.fixture(scope="session")
def grpc_client(replica) -> Client:
    with Client(replica["address"]) as client:
        yield client
