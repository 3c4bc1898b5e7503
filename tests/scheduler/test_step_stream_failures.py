"""Every way a rank's step stream can end reaches the engine as WorkerUnavailable naming the rank
and why, never as grpc.aio's own exceptions: a write on a call the worker ended raises
InvalidStateError ("RPC already finished"), which used to end the engine; a read of a cancelled
call raises CancelledError, which would pass for the engine's own cancellation. A fake rank on
loopback gRPC; the WorkerGroup is the real one."""
import asyncio
from concurrent import futures

import grpc
import pytest

from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import STEP_FORMAT
from scheduler_svc.step_plan import StepPlan
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable


class FailingRank(worker_pb2_grpc.WorkerServicer):
    """A rank whose Step handler raises on the first step, which ends the stream."""
    info = worker_pb2.WorkerInfo(rank=0, world_size=1, block_size=4, max_kv_blocks=8, model_fingerprint="fake",
                                 max_steps_in_flight=2, step_format=STEP_FORMAT)

    def Describe(self, request, context):
        return self.info

    def AllocateKVCache(self, request, context):
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests, context):
        for _ in requests:
            raise RuntimeError("broken step")
        yield from ()


def step(step_id: int) -> StepPlan:
    return StepPlan.build(step_id, [], [], [])


@pytest.fixture
def address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(FailingRank(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def on_group(address: str, scenario) -> None:
    async def run() -> None:
        group = WorkerGroup([address])
        await group.connect(timeout=10)
        try:
            await scenario(group)
        finally:
            await group.close()

    asyncio.run(run())


def test_reading_and_writing_a_stream_the_worker_ended_are_worker_failures(address):
    named = f"worker rank 0 at {address} is unavailable: Exception iterating responses: broken step"

    async def scenario(group: WorkerGroup) -> None:
        await group.send(step(1))
        with pytest.raises(WorkerUnavailable, match=named):
            await group.receive(1)
        with pytest.raises(WorkerUnavailable, match=named):  # the write of a step sent ahead
            await group.send(step(2))

    on_group(address, scenario)


def test_reading_a_cancelled_stream_is_a_worker_failure(address):
    async def scenario(group: WorkerGroup) -> None:
        group.streams[0].cancel()
        with pytest.raises(WorkerUnavailable, match=f"worker rank 0 at {address} is unavailable: Locally cancelled"):
            await group.receive(1)

    on_group(address, scenario)
