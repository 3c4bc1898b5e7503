"""Two replicas as routers see them, shared by the tests here: a worker, a scheduler and a gateway each,
the gateways serving vLLM's metric names too. Their KV pools are small (prefixes compete for them) and
two requests run at once (a third one waits)."""
from pathlib import Path

import pytest

from nanoserve.client import Client
from tests.routers.smg_process import running_replicas

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 72
MAX_NUM_SEQS = 2


@pytest.fixture(scope="session")
def replicas(tiny_model_dir, tmp_path_factory) -> list[dict]:
    log = tmp_path_factory.mktemp("routers") / "replicas.log"
    worker_flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                    "--max-num-seqs", str(MAX_NUM_SEQS))
    with running_replicas(Path(tiny_model_dir), log, 2, worker_flags, ("--vllm-metric-names",)) as started:
        yield started


@pytest.fixture(scope="session")
def replica(replicas) -> dict:
    return replicas[0]


@pytest.fixture(scope="session")
def grpc_client(replica) -> Client:
    with Client(replica["address"]) as client:
        yield client
