"""`nanoserve up --data-parallel-size N`: N replicas behind the SMG router, the real router binary,
every process on loopback; and a rolling restart of one of two replicas behind SMG under steady load,
which must fail no request (the replica drains: SMG stops sending to it and retries elsewhere)."""
import re
import signal
import subprocess
import threading
import time
from argparse import Namespace
from collections import Counter

import httpx
import openai
import pytest

from nanoserve.client import Client
from nanoserve_cli import layout
from nanoserve.flags import defaults
from nanoserve_cli.router import router_command, wait_routing
from tests.gateway.gateway_process import start_gateway, wait_listening
from tests.services.processes import (CLI, ENV, free_port, free_ports, running_service, shown_on_failure, stop,
                                      wait_serving)

pytest.importorskip("smg", reason="the SMG router (nanoserve[router]) is not installed")

FLAGS = ("--device", "cpu", "--block-size", "16", "--num-kv-blocks", "64")


def test_up_serves_two_replicas_through_the_router(tiny_model_dir, tmp_path):
    log = tmp_path / "up.log"
    port, worker_port, openai_port = free_ports(2)[0], free_ports(2)[0], free_ports(4)[0]
    launcher = subprocess.Popen(CLI + ["up", "--model", str(tiny_model_dir), "--data-parallel-size", "2",
                                       "--port", str(port), "--worker-base-port", str(worker_port),
                                       "--openai-port", str(openai_port), *FLAGS],
                                env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    with shown_on_failure(log):
        try:
            deadline = time.monotonic() + 240
            while "nanoserve is serving" not in log.read_text():
                assert launcher.poll() is None and time.monotonic() < deadline
                time.sleep(0.5)
            line = next(line for line in log.read_text().splitlines() if "nanoserve is serving" in line)
            addresses = re.findall(r"replica \d on (127\.0\.0\.1:\d+)", line)
            assert addresses == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], line
            assert f"the OpenAI API on http://127.0.0.1:{openai_port}/v1" in line
            with openai.OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="unused", max_retries=0,
                               timeout=60) as oai:
                routed = oai.completions.create(model=tiny_model_dir.name, prompt="Hello there", max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
            for address in addresses:  # each replica serves its own gRPC API, the same model
                with Client(address) as client:
                    assert client.generate("Hello there", max_tokens=6, temperature=0,
                                           ignore_eos=True).text == routed.choices[0].text
        finally:
            launcher.send_signal(signal.SIGINT)
            assert launcher.wait(timeout=120) == 0
    assert "Traceback" not in log.read_text()


def test_too_many_replicas_for_the_visible_gpus_is_one_line(tiny_model_dir):
    out = subprocess.run(CLI + ["up", "--model", str(tiny_model_dir), "--data-parallel-size", "3",
                                "--tensor-parallel-size", "2", "--device", "cuda", "--openai-port", str(free_port())],
                         env={**ENV, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == ("nanoserve up: --data-parallel-size 3 x --tensor-parallel-size 2 needs 6 GPUs, "
                                  "and 4 are visible (0,1,2,3): lower either size, or make more GPUs visible "
                                  "(CUDA_VISIBLE_DEVICES)")


def test_replicas_take_consecutive_blocks_of_the_visible_gpus():
    assert layout.visible_gpus("auto", {"CUDA_VISIBLE_DEVICES": "3, 5,6,7"}) == ["3", "5", "6", "7"]
    assert layout.visible_gpus("cpu", {"CUDA_VISIBLE_DEVICES": "0"}) == []
    assert layout.replica_gpus(["3", "5", "6", "7"], 2, 2) == [["3", "5"], ["6", "7"]]
    assert layout.replica_gpus(["0", "1", "2"], 3, 1) == [["0"], ["1"], ["2"]]
    assert layout.replica_gpus([], 8, 4) is None  # CPU: any number of replicas
    with pytest.raises(layout.TooFewGPUs, match="needs 4 GPUs, and 3 are visible"):
        layout.replica_gpus(["0", "1", "2"], 2, 2)


def test_replicas_without_an_openai_port_are_refused_in_one_line(tiny_model_dir):
    out = subprocess.run(CLI + ["up", "--model", str(tiny_model_dir), "--data-parallel-size", "2", "--device", "cpu"],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == ("nanoserve up: --data-parallel-size 2 serves the replicas through the SMG router "
                                  "on --openai-port: give one (e.g. --openai-port 8000)")


class SteadyLoad:
    """Clients sending short completions through the router, one after another, until stopped;
    every answer is checked whole (a stream must end in [DONE] with no error event)."""

    def __init__(self, url: str, model: str, clients: int = 3):
        self.url, self.model, self.outcomes, self.failures = url, model, Counter(), []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        stream, n = index % 2 == 0, 0
        with httpx.Client(timeout=120) as http:
            while not self.stopped.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"client {index} request {n}", "max_tokens": 12,
                        "ignore_eos": True, "stream": stream}
                try:
                    reply = http.post(self.url + "/v1/completions", json=body)
                    ok = reply.status_code == 200 and '"error"' not in reply.text and \
                        (not stream or reply.text.rstrip().endswith("data: [DONE]"))
                except httpx.HTTPError as err:
                    ok, reply = False, err
                self.outcomes[ok] += 1
                if not ok:
                    self.failures.append(getattr(reply, "text", repr(reply))[:300])

    def wait_completed(self, count: int, timeout: float = 60) -> None:
        """Until `count` requests have been answered (a loaded machine takes seconds for the first ones)."""
        deadline = time.monotonic() + timeout
        while sum(self.outcomes.values()) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(self.outcomes.values()) >= count, self.outcomes

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=120)


def start_replica(model_dir, log, gateway_port: int, worker_port: int, scheduler_port: int) -> list[subprocess.Popen]:
    """A replica as an orchestrator runs one: worker, scheduler and gateway, each its own process."""
    address = f"127.0.0.1:{scheduler_port}"
    procs = [subprocess.Popen(CLI + ["worker", "--model", str(model_dir), "--port", str(worker_port), *FLAGS[:4]],
                              env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT),
             subprocess.Popen(CLI + ["scheduler", "--workers", f"127.0.0.1:{worker_port}", "--port",
                                     str(scheduler_port)], env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT),
             start_gateway(address, gateway_port, log=log)]
    wait_serving(address, procs, log)
    wait_listening(f"http://127.0.0.1:{gateway_port}", procs[2], log)
    return procs


def test_a_rolling_restart_behind_the_router_fails_no_request(tiny_model_dir, tmp_path):
    logs = [tmp_path / "replica0.log", tmp_path / "replica1.log", tmp_path / "router.log"]
    gateway_ports, worker_ports, scheduler_ports = free_ports(2), free_ports(2), free_ports(2)
    router_port = free_port()
    with shown_on_failure(*logs):
        replicas = [start_replica(tiny_model_dir, logs[d], gateway_ports[d], worker_ports[d], scheduler_ports[d])
                    for d in range(2)]
        args = Namespace(host="127.0.0.1", openai_port=router_port, router_policy="cache_aware", shutdown_timeout=10,
                         max_num_seqs=defaults("up")["max_num_seqs"])
        router = subprocess.Popen(router_command(args, [f"http://127.0.0.1:{p}" for p in gateway_ports], free_port()),
                                  env=ENV, stdout=logs[2].open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{router_port}"
        try:
            wait_routing(url, 2, lambda: router.poll() is None, 60)
            load = SteadyLoad(url, tiny_model_dir.name)
            load.wait_completed(len(load.threads))  # the load is flowing: each client's next request in flight
            for proc in replicas[0]:  # SIGTERM to the whole replica at once, as Kubernetes stops a pod
                proc.send_signal(signal.SIGTERM)
            assert [proc.wait(timeout=60) for proc in replicas[0]] == [0, 0, 0]
            before = sum(load.outcomes.values())
            replicas[0] = start_replica(tiny_model_dir, logs[0], gateway_ports[0], worker_ports[0], scheduler_ports[0])
            wait_routing(url, 2, lambda: router.poll() is None, 60)  # the router takes the restarted one back
            time.sleep(3)
            load.stop()
            assert load.failures == [] and load.outcomes[True] > before > 0, load.outcomes
        finally:
            stop([router, *replicas[0], *replicas[1]])
