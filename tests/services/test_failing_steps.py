"""A worker whose step stream fails on every step (a bug that raises in its Step handler) or for a
while: the scheduler recovers each time, ends the held request UNAVAILABLE, clearly worded, once
groups fail in a row without completing a step (a crash loop), and serves on when the worker is
fixed. The scheduler is a real process on loopback; the worker a servicer in this process."""
import contextlib
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from nanoserve.client import Client
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import STEP_FORMAT
from scheduler_svc.recovery import MAX_FAILURES_IN_A_ROW
from tests.services.processes import free_port, start_scheduler, stop, wait_serving


class FlakyWorker(worker_pb2_grpc.WorkerServicer):
    """One rank that fails the first `failures` steps it is sent (None: every step), each by raising
    in its Step handler, which ends that step stream; later steps answer token 5 per sampled entry."""

    def __init__(self, model_dir: Path, failures: int | None):
        self.info = worker_pb2.WorkerInfo(
            model=str(model_dir), rank=0, world_size=1, block_size=16, max_kv_blocks=64, vocab_size=151936,
            max_model_len=1024, eos_token_ids=[151645], model_fingerprint="flaky", max_num_seqs=8,
            max_num_batched_tokens=1024, max_steps_in_flight=3, step_format=STEP_FORMAT)
        self.failures = failures
        self.failed = 0
        self.lock = threading.Lock()
        self.describe_delay = 0.0  # seconds each Describe (the scheduler's idle ping) takes

    def Describe(self, request, context):
        time.sleep(self.describe_delay)
        return self.info

    def AllocateKVCache(self, request, context):
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests, context):
        for request in requests:
            with self.lock:
                fails = self.failures is None or self.failed < self.failures
                self.failed += fails
            if fails:
                raise AttributeError("'FlakyWorker' object has no attribute 'idle_seconds'")
            yield worker_pb2.StepResponse(step_id=request.step_id, token_ids=[5] * sum(request.sample))


@contextlib.contextmanager
def flaky_service(model_dir: Path, log: Path, failures: int | None) -> Iterator[tuple[FlakyWorker, str]]:
    """A FlakyWorker and a scheduler process over it: the worker and the scheduler's address."""
    worker = FlakyWorker(model_dir, failures)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    worker_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port = free_port()
    scheduler = start_scheduler([f"127.0.0.1:{worker_port}"], port, log=log)
    try:
        wait_serving(f"127.0.0.1:{port}", [scheduler], log)
        yield worker, f"127.0.0.1:{port}"
        assert scheduler.poll() is None, log.read_text()[-4000:]  # failing steps never end the scheduler
    finally:
        stop([scheduler])
        server.stop(0)


def test_a_worker_failing_every_step_ends_the_request_and_the_scheduler_serves_on(tiny_model_dir, tmp_path: Path):
    log = tmp_path / "scheduler.log"
    with flaky_service(Path(tiny_model_dir), log, failures=None) as (worker, address), Client(address) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=4, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details()
        assert f"the worker group failed {MAX_FAILURES_IN_A_ROW} times in a row without completing a step" in details
        # The worker's own reason when its status wins the race with the scheduler's next write; else
        # gRPC's "Internal error from Core" for the write on the ending call.
        assert "the last failure: worker rank 0 at 127.0.0.1:" in details and " is unavailable: " in details
        assert worker.failed == MAX_FAILURES_IN_A_ROW  # bounded: no more groups were tried for it

        worker.failures = 0  # fixed: the same scheduler serves the next request
        wait_serving(address, [], log)
        done = client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True, timeout=60)
        assert list(done.token_ids) == [5] * 4
        stats = client.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_free) == (0, 0, stats.kv_blocks_total)
    assert "the engine stopped" not in log.read_text()


def test_a_worker_failing_a_few_steps_in_a_row_completes_the_request(tiny_model_dir, tmp_path: Path):
    log = tmp_path / "scheduler.log"
    with flaky_service(Path(tiny_model_dir), log, MAX_FAILURES_IN_A_ROW - 1) as (_, address), Client(address) as client:
        done = client.generate([1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True, timeout=60)
    assert list(done.token_ids) == [5] * 8
    text = log.read_text()
    assert text.count("worker group back after") == text.count("worker group failed") == MAX_FAILURES_IN_A_ROW - 1


def test_a_slow_idle_ping_is_not_a_failure(tiny_model_dir, tmp_path: Path):
    """A worker that takes 3 s to answer the idle scheduler's ping (a loaded machine) is slow, not
    failed: no recovery, and the next request is served."""
    log = tmp_path / "scheduler.log"
    with flaky_service(Path(tiny_model_dir), log, failures=0) as (worker, address), Client(address) as client:
        worker.describe_delay = 3.0
        time.sleep(5.5)  # idle: pinged every 2 s, each ping answered after 3 s
        worker.describe_delay = 0.0
        done = client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True, timeout=60)
    assert list(done.token_ids) == [5] * 4
    assert "worker group failed" not in log.read_text()
