"""Starting the gateway as users do: beside scheduler and workers with `nanoserve up --openai-port`,
alone with `nanoserve gateway`, probed with `python -m gateway_svc.healthcheck`; it waits for its
scheduler and says so."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve import flags
from nanoserve.client import Client
from nanoserve_cli import replica
from nanoserve_cli.cli import build_parser
from tests.gateway.gateway_process import wait_listening
from tests.services.processes import CLI, ENV, children, free_port, health_status, shown_on_failure, stop

PROBE = [sys.executable, "-m", "gateway_svc.healthcheck"]


def wait_for_child(parent: subprocess.Popen, module: str, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not (found := children(parent.pid, module)):
        assert parent.poll() is None and time.monotonic() < deadline, f"no {module} child started"
        time.sleep(0.01)
    return found[0][1]


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def test_up_with_openai_port_serves_the_openai_client_and_stops_it_with_the_rest(tiny_model_dir, tmp_path):
    """With two gateway processes: up stops them both."""
    port, worker_port, http_port = free_port(), free_port(), free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(CLI + ["up", "--model", str(tiny_model_dir), "--port", str(port), "--worker-base-port",
                                 str(worker_port), "--device", "cpu", "--block-size", "16",
                                 "--openai-port", str(http_port), "--api-server-count", "2"],
                          env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    address, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    with shown_on_failure(log):  # a read timeout here once in CI, unexplained: the log would say more
        try:
            # The worker held (SIGSTOP) until a gateway found the scheduler not serving: however quickly
            # the worker loads, a gateway started beside the scheduler meets it before it serves.
            worker = wait_for_child(up, "worker_svc")
            os.kill(worker, signal.SIGSTOP)
            try:
                wait_for_line(log, f"waiting for the scheduler: the scheduler at {address}", up)
            finally:
                os.kill(worker, signal.SIGCONT)
            wait_for_line(log, f"the OpenAI API on {url}/v1); Ctrl-C stops it", up)
            text = log.read_text()  # started beside the scheduler, the gateway waited for it and said so
            waiting = text.index(f"waiting for the scheduler: the scheduler at {address}")
            assert waiting < text.index(f"the scheduler at {address} serves {tiny_model_dir}")
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as oai:
                got = oai.completions.create(model=Path(tiny_model_dir).name, prompt="Hello there", max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})
            with Client(address) as client:
                want = client.generate("Hello there", max_tokens=6, temperature=0, ignore_eos=True)
            assert got.choices[0].text == want.text and got.usage.completion_tokens == 6
        finally:
            up.send_signal(signal.SIGTERM)
            assert up.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
    assert health_status(address) is None


def test_nanoserve_gateway_alone_serves_a_running_scheduler(service, tmp_path):
    port, log = free_port(), tmp_path / "gateway.log"
    gateway = subprocess.Popen(CLI + ["gateway", "--scheduler", service["address"], "--host", "127.0.0.1",
                                      "--port", str(port), "--served-model-name", "my-model"],
                               env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(url, gateway, log)
        wait_for_line(log, f"the scheduler at {service['address']} serves", gateway, timeout=30)
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["my-model"]
        probe = subprocess.run(PROBE + ["--port", str(port)], env=ENV, capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0 and probe.stdout.startswith("healthy:"), probe.stderr
    finally:
        stop([gateway])


def test_without_its_scheduler_the_gateway_says_it_waits_and_its_probe_fails(tmp_path):
    port, nobody, log = free_port(), f"127.0.0.1:{free_port()}", tmp_path / "gateway.log"
    gateway = subprocess.Popen(CLI + ["gateway", "--scheduler", nobody, "--port", str(port)],  # loopback by default
                               env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_for_line(log, f"waiting for the scheduler: the scheduler at {nobody} does not answer", gateway, 60)
        line = next(line for line in log.read_text().splitlines() if "waiting for the scheduler" in line)
        assert line.split()[2:4] == ["INFO", "nanoserve.gateway"], line  # its level, as every service's line
        probe = subprocess.run(PROBE + ["--port", str(port)], env=ENV, capture_output=True, text=True, timeout=30)
        assert probe.returncode == 1
        assert probe.stderr.startswith(f"unhealthy: http://127.0.0.1:{port}/health answered 503: the scheduler "
                                       f"at {nobody} does not answer"), probe.stderr
    finally:
        stop([gateway])
    probe = subprocess.run(PROBE + ["--port", str(port)], env=ENV, capture_output=True, text=True, timeout=30)
    assert probe.returncode == 1 and "did not answer" in probe.stderr


@pytest.mark.parametrize("argv", [CLI + ["gateway", "--help"], [sys.executable, "-m", "gateway_svc", "--help"]])
def test_gateway_entry_points_list_their_flags_from_the_table(argv):
    out = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for f in flags.flags_of("gateway"):
        assert f.name in out.stdout and f.env in out.stdout, f.name


def test_up_hands_the_gateway_its_flags_and_the_scheduler_it_starts(monkeypatch, tmp_path):
    for f in flags.FLAGS:
        monkeypatch.delenv(f.env, raising=False)
    up = build_parser().parse_args(["up", "--host", "127.0.0.2", "--port", "6000", "--openai-port", "6001",
                                    "--tokenizer", str(tmp_path), "--served-model-name", "tiny",
                                    "--api-server-count", "3", "--shutdown-timeout", "7"])
    command = replica.gateway_command(up)
    assert command[:3] == [sys.executable, "-m", "gateway_svc"]
    args = flags.parse("gateway", command[3:])
    assert (args.scheduler, args.host, args.port) == ("127.0.0.2:6000", "127.0.0.2", 6001)
    assert (args.served_model_name, args.api_server_count, args.shutdown_timeout) == ("tiny", 3, 7)
    # the tokenizer is the scheduler's alone (Chat, Tokenize, Detokenize)
    assert {f.dest for f in flags.shared("up", "gateway")} == {"served_model_name", "api_server_count",
                                                               "shutdown_timeout", "vllm_metric_names"}
