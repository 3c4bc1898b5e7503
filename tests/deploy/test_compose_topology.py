"""Each compose.yaml deployment run for real as local processes: every service's own command and
environment, with only what belongs to containers rewritten (service hosts and ports become free
loopback ports, the model path the tiny checkpoint, the device the CPU), each started once what it
depends on is healthy. The compose health checks must pass against them, then a greedy Generate runs
through the public gRPC stubs and the same request through the gateway's OpenAI API."""
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from nanoserve.v1 import llm_pb2, llm_pb2_grpc
from tests.deploy.compose_model import Deployment, cli_args, deployments, raw_services
from tests.services.processes import ENV, free_port, stop, wait_serving

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("worker_svc.server") and importlib.util.find_spec("scheduler_svc.server")),
    reason="worker_svc.server and scheduler_svc.server are not written yet")

SERVICES = raw_services()  # variables at their defaults
MAX_TOKENS = 8


class Loopback:
    """Gives each compose address (service:port) its own free port on 127.0.0.1."""

    def __init__(self, services: dict[str, dict]):
        self.services = services
        self.ports: dict[tuple[str, int], int] = {}

    def address(self, service: str, port: int) -> str:
        key = (service, port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return f"127.0.0.1:{self.ports[key]}"

    def rewrite(self, value: str, own: str) -> str:
        """`value` with each service:port, and `own` service's 127.0.0.1:port, made loopback."""
        def replace(match: re.Match) -> str:
            host = own if match[1] == "127.0.0.1" else match[1]
            return self.address(host, int(match[2])) if host in self.services else match[0]
        return re.sub(r"([\w.-]+):(\d+)", replace, value)


def service_port(name: str, net: Loopback) -> str:
    return net.address(name, cli_args(name, SERVICES[name]).port).split(":")[1]


def start(name: str, net: Loopback, model_dir: Path, log: Path) -> subprocess.Popen:
    """The service's compose command and environment, rewritten, with the container bits overridden."""
    service, args = SERVICES[name], cli_args(name, SERVICES[name])
    command = [net.rewrite(str(arg), name) for arg in service["command"]]
    command += ["--host", "127.0.0.1", "--port", service_port(name, net)]
    if args.command == "scheduler" and args.metrics_port:
        command += ["--metrics-port", net.address(name, args.metrics_port).split(":")[1]]
    if args.command == "worker":
        command += ["--model", str(model_dir), "--device", "cpu"]
    env = {k: v for k, v in ENV.items() if not k.startswith("NANOSERVE_")}
    env.update({k: net.rewrite(str(v), name) for k, v in (service.get("environment") or {}).items()})
    return subprocess.Popen([sys.executable, "-m", "nanoserve_cli", *command], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


def assert_compose_healthcheck_passes(name: str, net: Loopback) -> None:
    _, program, *argv = SERVICES[name]["healthcheck"]["test"]  # ["CMD", "python", ...]
    assert program == "python"
    argv = [net.rewrite(a, name) for a in argv]
    if cli_args(name, SERVICES[name]).command == "gateway":  # its probe takes the gateway's flags
        argv += ["--port", service_port(name, net)]
    result = subprocess.run([sys.executable, *argv], env=ENV, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{name} health check: {result.stderr}"


def wait_healthy(name: str, net: Loopback, procs: list[subprocess.Popen], log: Path, timeout: float = 120) -> None:
    """Until the service's compose health check passes (depends_on: service_healthy)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return assert_compose_healthcheck_passes(name, net)
        except AssertionError:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise AssertionError(f"{name} never became healthy:\n{log.read_text()[-4000:]}") from None
            time.sleep(0.5)


@pytest.mark.parametrize("group", deployments(SERVICES), ids=lambda g: g.scheduler)
def test_deployment_serves_a_greedy_generate(group: Deployment, tiny_model_dir, tmp_path):
    net, log = Loopback(SERVICES), tmp_path / "services.log"
    procs = [start(name, net, Path(tiny_model_dir), log) for name in group.workers]
    try:
        for name in group.workers:  # depends_on: service_healthy
            wait_serving(net.address(name, cli_args(name, SERVICES[name]).port), procs, log)
            assert_compose_healthcheck_passes(name, net)
        procs.append(start(group.scheduler, net, Path(tiny_model_dir), log))
        address = net.address(group.scheduler, cli_args(group.scheduler, SERVICES[group.scheduler]).port)
        wait_serving(address, procs, log)
        assert_compose_healthcheck_passes(group.scheduler, net)
        (gateway,) = group.gateways
        procs.append(start(gateway, net, Path(tiny_model_dir), log))
        wait_healthy(gateway, net, procs, log)

        prompt = [(i * 7919) % 150000 for i in range(1, 13)]
        sampling = llm_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        request = llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=prompt), sampling=sampling)
        with grpc.insecure_channel(address) as channel:
            replies = list(llm_pb2_grpc.LLMStub(channel).Generate(request, timeout=120))
        tokens = [t for reply in replies for t in reply.token_ids]
        assert len(tokens) == MAX_TOKENS, log.read_text()[-4000:]
        assert replies[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
        usage = replies[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), MAX_TOKENS)

        served = cli_args(gateway, SERVICES[gateway]).served_model_name  # compose's MODEL, the Hub id
        body = {"model": served, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        completion = httpx.post(f"http://127.0.0.1:{service_port(gateway, net)}/v1/completions", json=body,
                                timeout=120).json()
        assert completion["model"] == served, completion
        assert completion["choices"][0]["text"] == "".join(reply.text for reply in replies)
        assert completion["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        stop(procs)
