"""Two replicas as routers see them, shared by the tests here: a worker, a scheduler publishing KV
events and a gateway serving vLLM's metric names too, each. Their KV pools are small (prefixes compete
for them) and two requests run at once (a third one waits)."""
import json
from pathlib import Path

import pytest

from nanoserve.client import Client
from tests.routers.smg_process import running_replicas
from tests.services.processes import free_port

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 72
MAX_NUM_SEQS = 2


@pytest.fixture(scope="session")
def replicas(tiny_model_dir, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("routers")
    worker_flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                    "--max-num-seqs", str(MAX_NUM_SEQS))
    # vLLM's KV events config: the PUB socket on a local IPC path (bound), the replay socket on loopback
    kv_events = [{"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/kv-events-{index}",
                  "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": f"kv@replica-{index}@tiny"}
                 for index in range(2)]
    with running_replicas(Path(tiny_model_dir), folder / "replicas.log", worker_flags, ("--vllm-metric-names",),
                          [("--kv-events-config", json.dumps(config)) for config in kv_events]) as started:
        yield [{**replica, "kv_events": config, "log": folder / "replicas.log"}
               for replica, config in zip(started, kv_events)]


@pytest.fixture(scope="session")
def replica(replicas) -> dict:
    return replicas[0]


@pytest.fixture(scope="session")
def grpc_client(replica) -> Client:
    with Client(replica["address"]) as client:
        yield client
