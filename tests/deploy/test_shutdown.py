"""Stopping nanoserve with requests in flight, as a person (Ctrl-C on `nanoserve up`) and an
orchestrator (SIGTERM to every process of a replica at once) do: the servers drain (NOT_SERVING, new
requests refused as draining, those in flight finish), end what is left after --shutdown-timeout with
"the server is shutting down" (a gRPC status, an OpenAI-shaped SSE error event), exit 0 and log the
stop as INFO lines, never as an error or a traceback."""
import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from nanoserve.client import Client
from nanoserve.stopping import DRAINING, SHUTTING_DOWN
from tests.services.processes import (CLI, ENV, free_port, health_status, running_service, shown_on_failure,
                                      wait_serving)

PROMPT = [(i * 7919) % 150000 for i in range(1, 20)]
LONG = 2000  # more tokens than the drain lets run (a minute here), within the 2,048-token pool: the deadline ends these


class Outcome:
    """A request run on a thread: its messages so far, then how it ended."""

    def __init__(self, work):
        self.events: list = []
        self.ended = ""
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            work(self.events)
            self.ended = "finished"
        except grpc.RpcError as err:
            self.ended = f"{err.code().name}: {err.details()}"

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.events, f"no output within {timeout}s (ended: {self.ended!r})"

    def result(self, timeout: float = 60) -> str:
        self.thread.join(timeout)
        return self.ended


def grpc_stream(address: str, max_tokens: int) -> Outcome:
    def work(events: list) -> None:
        with Client(address) as client:
            for message in client.stream(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                events.append(message)
    return Outcome(work)


def sse_stream(url: str, max_tokens: int) -> Outcome:
    def work(events: list) -> None:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
    return Outcome(work)


@contextlib.contextmanager
def started_up(model_dir: Path, log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """`nanoserve up` with a gateway, serving: (the launcher, the gRPC address, the OpenAI URL); killed
    at the end if the test has not stopped it."""
    port, openai_port = free_port(), free_port()
    launcher = subprocess.Popen(CLI + ["up", "--model", str(model_dir), "--port", str(port), "--worker-base-port",
                                       str(free_port()), "--openai-port", str(openai_port), "--device", "cpu",
                                       "--block-size", "16", "--num-kv-blocks", "128", *flags],
                                env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    address, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{openai_port}"
    try:
        wait_serving(address, [launcher], log)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield launcher, address, url
    finally:
        if launcher.poll() is None:  # a second signal: everything stops at once
            launcher.send_signal(signal.SIGINT)
            time.sleep(0.5)
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=60)


def assert_clean_stop(log: Path) -> None:
    text = log.read_text(errors="replace")
    for sign in ("Traceback", " ERROR ", "CRITICAL", "worker group failed", "Cancelling all calls"):
        assert sign not in text, f"{sign!r} in the log:\n{text[-4000:]}"


def assert_draining(address: str, url: str) -> None:
    """NOT_SERVING and 503 on /health, new requests refused with the draining message."""
    assert health_status(address) == "NOT_SERVING"
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["message"] == DRAINING
    with Client(address) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(PROMPT, max_tokens=4)
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE, DRAINING)
    completion = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
    assert completion.status_code == 503 and completion.json()["error"]["message"] == DRAINING


def test_ctrl_c_drains_then_ends_what_is_left(tiny_model_dir, tmp_path):
    log = tmp_path / "up.log"
    with shown_on_failure(log), started_up(tiny_model_dir, log, "--shutdown-timeout", "5") as (launcher, address, url):
        short, long_grpc, long_sse = grpc_stream(address, 24), grpc_stream(address, LONG), sse_stream(url, LONG)
        for outcome in (short, long_grpc, long_sse):
            outcome.wait_started()
        launcher.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher only: its children have
        time.sleep(1)                        # sessions of their own
        assert_draining(address, url)
        assert short.result() == "finished" and len(short.events) and short.events[-1].finish_reason
        assert long_grpc.result() == f"UNAVAILABLE: {SHUTTING_DOWN}"
        assert long_sse.result() == "finished"
        error, done = long_sse.events[-2:]
        assert json.loads(error) == {"error": {"message": SHUTTING_DOWN, "type": "service_unavailable_error",
                                               "param": None, "code": "unavailable"}}
        assert done == "[DONE]"
        assert launcher.wait(timeout=60) == 0
        assert_clean_stop(log)


def test_a_second_ctrl_c_stops_at_once(tiny_model_dir, tmp_path):
    log = tmp_path / "up.log"
    with shown_on_failure(log), started_up(tiny_model_dir, log, "--shutdown-timeout", "600") as (launcher, address, _):
        stream = grpc_stream(address, LONG)
        stream.wait_started()
        launcher.send_signal(signal.SIGINT)
        time.sleep(1)
        stopped = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 30  # not the 600 s drain
        assert stream.result() == f"UNAVAILABLE: {SHUTTING_DOWN}"
        assert_clean_stop(log)


def test_sigterm_to_a_whole_replica_finishes_its_requests(tiny_model_dir, tmp_path):
    """As Kubernetes stops a pod: every process gets SIGTERM at the same moment. The worker keeps
    serving until its scheduler, which finishes the stream in flight, lets go."""
    log = tmp_path / "replica.log"
    with shown_on_failure(log), running_service(tiny_model_dir, log, worker_flags=("--block-size", "16"),
                                                scheduler_flags=("--shutdown-timeout", "60")) as replica:
        stream = grpc_stream(replica["address"], 48)
        stream.wait_started()
        for proc in replica["procs"]:
            proc.send_signal(signal.SIGTERM)
        assert stream.result() == "finished" and stream.events[-1].finish_reason
        assert [proc.wait(timeout=60) for proc in replica["procs"]] == [0, 0]
        assert_clean_stop(log)
