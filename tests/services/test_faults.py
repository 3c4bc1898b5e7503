"""Faults: workers that are missing at start-up or die mid-run never leave a request hanging."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from nanoserve.client import Client
from tests.services.processes import (free_port, health_status, running_service, start_scheduler, start_worker, stop,
                            wait_answering, wait_serving)

NOT_SERVING = "NOT_SERVING"


def test_missing_worker_is_named_and_requests_get_unavailable(tmp_path: Path):
    log = tmp_path / "scheduler.log"
    worker = f"127.0.0.1:{free_port()}"
    address = f"127.0.0.1:{free_port()}"
    sched = start_scheduler([worker], int(address.split(":")[1]), "--worker-connect-timeout", "4", log=log)
    try:
        assert wait_answering(address) == NOT_SERVING
        with Client(address) as client, pytest.raises(grpc.RpcError) as info:
            client.generate("hello", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sched.wait(timeout=30) != 0
        text = log.read_text()
        assert f"waiting for worker rank 0 at {worker}" in text
        assert f"worker rank 0 at {worker} did not answer" in text
    finally:
        stop([sched])


def test_worker_not_back_in_time_fails_in_flight_requests_then_recovers(tiny_model_dir, tiny_tied_model_dir,
                                                                         tmp_path: Path):
    """Nothing restarts the worker: after --worker-restart-timeout the held request ends
    UNAVAILABLE, new ones are refused, and a worker started later serves again."""
    log = tmp_path / "services.log"
    flags = ("--block-size", "16", "--num-kv-blocks", "128")
    with running_service(Path(tiny_model_dir), log, worker_flags=flags,
                         scheduler_flags=("--worker-restart-timeout", "2")) as svc, Client(svc["address"]) as client:
        worker = svc["workers"][0]
        worker_port = worker.args[worker.args.index("--port") + 1]
        stream = client.stream([1, 2, 3, 4], max_tokens=2000, temperature=0, ignore_eos=True, timeout=60)
        next(stream)
        worker.kill()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"worker rank 0 at 127.0.0.1:{worker_port}" in info.value.details()
        assert health_status(svc["address"]) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        restarted = start_worker(Path(tiny_model_dir), int(worker_port), *flags, log=log)
        svc["procs"].append(restarted)
        wait_serving(svc["address"], [svc["scheduler"], restarted], log)
        done = client.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)
        assert len(done.token_ids) == 3
        stats = client.stats()  # the ended request left nothing behind
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_free) == (0, 0, stats.kv_blocks_total)
        assert "no worker group came back within 2s (--worker-restart-timeout)" in log.read_text()

        # Back with another model, the worker can never serve this scheduler: it exits for its supervisor.
        restarted.kill()
        restarted.wait()
        svc["procs"].append(start_worker(Path(tiny_tied_model_dir), int(worker_port), *flags, log=log))
        assert svc["scheduler"].wait(timeout=120) == 1
        assert "this scheduler was started for" in log.read_text()


def test_a_full_waiting_queue_refuses_with_resource_exhausted(tiny_model_dir, tmp_path: Path):
    """One sequence runs at a time and one may wait: a burst of 12 gets some refusals, clearly
    worded, and every admitted request still completes in full."""
    flags = ("--block-size", "16", "--num-kv-blocks", "64", "--max-num-seqs", "1")
    with running_service(Path(tiny_model_dir), tmp_path / "services.log", worker_flags=flags,
                         scheduler_flags=("--max-waiting", "1")) as svc, Client(svc["address"]) as client:
        def run(i: int):
            try:
                return client.generate([i + 1] * 8, max_tokens=20, temperature=0, ignore_eos=True)
            except grpc.RpcError as err:
                return err

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(run, range(12)))
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    done = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert refused and done
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already waiting" in r.details() for r in refused)
    assert all(len(r.token_ids) == 20 for r in done)
