"""A worker serves one scheduler at a time: a second scheduler pointed at a live worker is refused
and cannot reset it, calls of another session are refused naming the holder, and a scheduler
started after the first one died takes the worker over. Real processes on loopback."""
import signal
from pathlib import Path

import grpc
import pytest

from nanoserve.client import Client
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import SESSION_KEY
from tests.services.processes import free_port, running_service, start_scheduler, stop, wait_serving

PROMPT = [(i * 104729) % 150000 for i in range(1, 30)]
WORKER_FLAGS = ("--block-size", "16", "--num-kv-blocks", "64")


def greedy(address: str) -> list[int]:
    with Client(address) as client:
        return client.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids


def test_one_scheduler_at_a_time_and_a_restarted_one_takes_over(tiny_model_dir, tmp_path: Path):
    log = tmp_path / "services.log"
    with running_service(Path(tiny_model_dir), log, worker_flags=WORKER_FLAGS) as svc:
        worker = f"127.0.0.1:{svc['workers'][0].args[svc['workers'][0].args.index('--port') + 1]}"
        before = greedy(svc["address"])

        second_log = tmp_path / "second.log"
        second = start_scheduler([worker], free_port(), log=second_log)
        assert second.wait(timeout=60) == 1
        refusal = second_log.read_text()
        assert f"cannot start: worker rank 0 at {worker} refused this scheduler: this worker serves scheduler " \
               "session" in refusal and "its step stream is open" in refusal

        with grpc.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for call in (lambda: stub.AllocateKVCache(worker_pb2.AllocateKVCacheRequest(num_blocks=8),
                                                      metadata=((SESSION_KEY, "intruder"),)),
                         lambda: list(stub.Step(iter([worker_pb2.StepRequest(step_id=1)]),
                                                metadata=((SESSION_KEY, "intruder"),)))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "scheduler session" in info.value.details()
        assert greedy(svc["address"]) == before  # the worker was never reset

        svc["scheduler"].send_signal(signal.SIGKILL)  # dies without a word; its stream closes
        svc["scheduler"].wait(timeout=10)
        address = f"127.0.0.1:{free_port()}"
        restarted = start_scheduler([worker], int(address.split(":")[1]), log=log)
        svc["procs"].append(restarted)
        wait_serving(address, [restarted], log)
        assert greedy(address) == before
    stop([second])
