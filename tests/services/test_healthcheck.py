"""The container health probe against a real grpc.health.v1 server, run as Docker runs it."""
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoserve.healthcheck import LIVENESS, serving_status
from tests.services.processes import ENV, free_port, start_scheduler, wait_answering

Status = health_pb2.HealthCheckResponse


@pytest.fixture
def server():
    """A health server on loopback whose statuses the test sets; yields (address, servicer)."""
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    address = f"127.0.0.1:{free_port()}"
    grpc_server.add_insecure_port(address)
    grpc_server.start()
    yield address, servicer
    grpc_server.stop(grace=0)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve.healthcheck", *args], env=ENV,
                          capture_output=True, text=True, timeout=30)


def test_serving_server_is_healthy(server):
    address, servicer = server
    servicer.set("", Status.SERVING)
    result = probe("--address", address)
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_not_serving_server_is_unhealthy(server):
    address, servicer = server
    servicer.set("", Status.NOT_SERVING)
    result = probe("--address", address)
    assert result.returncode == 1
    assert "reports NOT_SERVING" in result.stderr


def test_named_service_is_asked_about(server):
    address, servicer = server
    servicer.set("", Status.NOT_SERVING)
    servicer.set("nanoserve.v1.LLM", Status.SERVING)
    assert probe("--address", address, "--service", "nanoserve.v1.LLM").returncode == 0
    unknown = probe("--address", address, "--service", "no.such.Service")
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr


def test_nothing_listening_fails_fast():
    result = probe("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert "did not answer: UNAVAILABLE" in result.stderr


def test_scheduler_is_alive_while_it_is_not_serving(tmp_path):
    """A scheduler still waiting for its workers is NOT_SERVING, yet its liveness service (what a
    Kubernetes liveness probe asks) says SERVING: a probe must not restart it and lose the requests
    it would hold through a worker recovery."""
    address = f"127.0.0.1:{free_port()}"
    scheduler = start_scheduler([f"127.0.0.1:{free_port()}"], int(address.rsplit(":", 1)[1]),
                                "--worker-connect-timeout", "60", log=tmp_path / "scheduler.log")
    try:
        assert wait_answering(address) == "NOT_SERVING", (tmp_path / "scheduler.log").read_text()
        assert serving_status(address, LIVENESS) == "SERVING"
        assert probe("--address", address, "--service", LIVENESS).returncode == 0
    finally:
        scheduler.kill()
        scheduler.wait()
