"""A replica's scheduler SIGKILLed mid-stream loses no request (DESIGN §11, replica loss): two
replicas on CPU, each a worker and a scheduler, and streams that begin on the first. Through the
Python client given both addresses, the gateway given both schedulers (an SSE stream) and the Node
example, every stream resumes on the second replica and ends with what an undisturbed run on it
gives. After each kill the first replica's scheduler is started again on its worker."""
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from nanoserve.client import Client, gather
from tests.gateway.gateway_process import running_gateway
from tests.services.processes import (REPO, free_port, shown_on_failure, start_scheduler, start_worker, stop,
                                      wait_serving)

FLAGS = ("--block-size", "16", "--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "256")
PROMPT = "The sea is calm tonight, and the"
MAX_TOKENS = 100  # long enough that the kill lands mid-stream: it comes as the first tokens do (~100 steps early)
REQUESTS = [  # (name, sampling): greedy, seeded, seeded with penalties and logprobs, two seeded completions
    ("greedy", {"temperature": 0.0}),
    ("seeded", {"temperature": 0.9, "seed": 11}),
    ("penalties", {"temperature": 0.8, "seed": 12, "repetition_penalty": 1.2, "frequency_penalty": 0.3,
                   "logprobs": 1}),
    ("two", {"temperature": 0.9, "seed": 13, "n": 2}),
]


class Replica:
    """A worker and its scheduler; the scheduler can be killed and started again on the same worker."""

    def __init__(self, model: Path, log: Path):
        self.log = log
        self.worker_address, self.address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.worker = start_worker(model, int(self.worker_address.split(":")[1]), *FLAGS, log=log)
        self.scheduler: subprocess.Popen | None = None
        self.start_scheduler()

    def start_scheduler(self) -> None:
        self.scheduler = start_scheduler([self.worker_address], int(self.address.split(":")[1]), log=self.log)
        wait_serving(self.address, [self.worker, self.scheduler], self.log)

    def kill_scheduler(self) -> None:
        self.scheduler.kill()
        self.scheduler.wait()

    def running(self) -> int:
        """Sequences running on this replica (0 when its scheduler does not answer)."""
        with Client(self.address) as client:
            try:
                return client.stats().num_running
            except Exception:  # noqa: BLE001 (not up yet)
                return 0

    def stop(self) -> None:
        stop([self.worker, self.scheduler])


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("failover") / "replicas.log"
    first = Replica(Path(tiny_model_dir), log)
    try:
        second = Replica(Path(tiny_model_dir), log)
        try:
            with shown_on_failure(log):
                yield first, second
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.fixture
def first_serving(replicas):
    """The replicas, the first's scheduler started again after a test that killed it."""
    yield replicas
    first = replicas[0]
    if first.scheduler.poll() is not None:
        first.start_scheduler()


def kill_when_running(replica: Replica, count: int) -> None:
    """SIGKILLs the replica's scheduler once `count` sequences run on it."""
    deadline = time.monotonic() + 60
    while replica.running() < count and time.monotonic() < deadline:
        time.sleep(0.02)
    replica.kill_scheduler()


def run_all(client: Client, meanwhile=lambda: None) -> dict[str, list]:
    """REQUESTS streamed at once, each on a thread, while `meanwhile` runs: their completions by name."""
    got = {}

    def run(name: str, sampling: dict) -> None:
        got[name] = gather(client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120, **sampling))

    threads = [threading.Thread(target=run, args=request) for request in REQUESTS]
    for thread in threads:
        thread.start()
    meanwhile()
    for thread in threads:
        thread.join(timeout=120)
    return got


def test_the_python_client_resumes_streams_on_the_next_replica(first_serving):
    first, second = first_serving
    with Client(second.address) as client:
        want = run_all(client)
    moved = []
    with Client([first.address, second.address], on_failover=moved.append) as client:
        got = run_all(client, lambda: kill_when_running(first, count=5))
    assert len(moved) == len(REQUESTS)  # each stream moved once, mid-way
    assert all((e.from_address, e.to_address) == (first.address, second.address) for e in moved)
    assert any(e.received for e in moved)  # the kill came mid-stream
    for name, _ in REQUESTS:
        assert [(c.token_ids, c.text, c.finish_reason, c.usage.completion_tokens) for c in got[name]] == \
            [(c.token_ids, c.text, c.finish_reason, c.usage.completion_tokens) for c in want[name]], name
        assert [row.token.token_id for c in got[name] for row in c.logprobs] == \
            [row.token.token_id for c in want[name] for row in c.logprobs]


def test_the_gateway_keeps_an_sse_stream_going_on_its_fallback(first_serving, model_name):
    first, second = first_serving
    request = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 21,
               "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    with running_gateway(f"{first.address},{second.address}", first.log) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        want = oai.completions.create(**request).choices[0]
        text, token_ids, finish = "", [], None
        for number, chunk in enumerate(oai.completions.create(stream=True, **request)):
            choice = chunk.choices[0]
            text += choice.text
            token_ids += choice.model_extra["token_ids"]
            finish = choice.finish_reason or finish
            if number == 3:
                first.kill_scheduler()
    assert (token_ids, text, finish) == (want.model_extra["token_ids"], want.text, "length")
    assert len(token_ids) == MAX_TOKENS
    assert f"the stream from {first.address} broke" in first.log.read_text()


@pytest.fixture
def model_name(tiny_model_dir) -> str:
    return Path(tiny_model_dir).name


def test_the_node_example_resumes_on_the_next_replica(first_serving):
    node = shutil.which("node")
    if node is None or not (REPO / "tests/services/node/node_modules").is_dir():
        pytest.skip("needs node and `make install`'s tests/services/node/node_modules")
    first, second = first_serving
    argv = [node, str(REPO / "tests/services/node/generate.mjs"), "--max-tokens", str(MAX_TOKENS),
            "--temperature", "0.9", "--seed", "31"]
    want = json.loads(subprocess.run(argv + [second.address], capture_output=True, text=True, check=True,
                                     timeout=120).stdout)
    proc = subprocess.Popen(argv + [f"{first.address},{second.address}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    kill_when_running(first, count=1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert (got["token_ids"], got["text"], got["usage"]) == (want["token_ids"], want["text"], want["usage"])
    assert f"the stream from {first.address} broke" in err
