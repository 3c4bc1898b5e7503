"""What the scheduler takes from the workers' handshake: the pipeline depth (the smallest
max_steps_in_flight of any rank, a rank reporting none refused by name) and rank 0's step
timings. Fake ranks on loopback gRPC stand in for the workers; the engine and its WorkerGroup
are the real ones."""
import asyncio
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import STEP_FORMAT
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable

STEP_SECONDS = 0.01  # long enough for the engine to queue every step it may before a reply


class FakeRank(worker_pb2_grpc.WorkerServicer):
    """Answers each step after STEP_SECONDS (rank 0 with token 5 per sampled entry) and records
    how many steps had arrived unanswered, at most, since the last reply."""

    def __init__(self, rank: int, world_size: int, max_steps_in_flight: int, host_seconds: float,
                 step_format: int = STEP_FORMAT):
        self.info = worker_pb2.WorkerInfo(rank=rank, world_size=world_size, block_size=4, max_kv_blocks=64,
                                          max_model_len=64, model_fingerprint="fake",
                                          max_steps_in_flight=max_steps_in_flight, step_format=step_format)
        self.host_seconds = host_seconds
        self.most_unanswered = 0

    def Describe(self, request, context):
        return self.info

    def AllocateKVCache(self, request, context):
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests, context):
        arrived: queue.Queue = queue.Queue()

        def read() -> None:  # beside the replies, so steps sent ahead queue up here
            try:
                for request in requests:
                    arrived.put(request)
            except grpc.RpcError:  # the scheduler cancelled the stream
                pass
            arrived.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (request := arrived.get()) is not None:
            time.sleep(STEP_SECONDS)
            self.most_unanswered = max(self.most_unanswered, 1 + arrived.qsize())
            tokens = [5] * sum(request.sample) if self.info.rank == 0 else []
            yield worker_pb2.StepResponse(step_id=request.step_id, token_ids=tokens, host_seconds=self.host_seconds)


def serve(ranks: list[FakeRank]) -> tuple[list[grpc.Server], list[str]]:
    servers, addresses = [], []
    for rank in ranks:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(rank, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    return servers, addresses


@pytest.mark.parametrize("second, problem", [
    (FakeRank(1, 2, 0, 0.0), "too old"),  # an old worker sends neither field
    (FakeRank(1, 2, 3, 0.0, step_format=1), f"reads step format 1, this scheduler writes {STEP_FORMAT}"),
])
def test_a_rank_of_another_version_is_refused_by_name(second, problem):
    servers, addresses = serve([FakeRank(0, 2, 3, 0.0), second])

    async def connect() -> None:
        group = WorkerGroup(addresses)
        try:
            await group.connect(timeout=10)
        finally:
            await group.close()

    try:
        with pytest.raises(WorkerUnavailable, match=f"worker rank 1 at {addresses[1]} .*{problem}"):
            asyncio.run(connect())
    finally:
        for server in servers:
            server.stop(0)


def test_engine_keeps_the_smallest_depth_in_flight_and_counts_rank_0_host_time():
    ranks = [FakeRank(0, 2, 2, host_seconds=0.25), FakeRank(1, 2, 3, host_seconds=100.0)]
    servers, addresses = serve(ranks)

    async def generate() -> Engine:
        group = WorkerGroup(addresses)
        await group.connect(timeout=10)
        config = SchedulerConfig(num_kv_blocks=group.num_blocks, block_size=4, max_model_len=64)
        engine = Engine(group, config, restart_timeout=10)
        engine.start()
        streams = [engine.submit(Sequence(engine.new_seq_id(), [1, 2, 3], SamplingOptions(max_tokens=8)))
                   for _ in range(4)]
        for stream in streams:
            while not stream.finished:
                await stream.wakeup.wait()
                stream.wakeup.clear()  # as the request handler does, before it reads
                stream.take()
        engine.task.cancel()
        engine.waker_task.cancel()
        await group.close()
        return engine

    try:
        engine = asyncio.run(generate())
    finally:
        for server in servers:
            server.stop(0)
    assert engine.group.max_steps_in_flight == 2
    assert [rank.most_unanswered for rank in ranks] == [2, 2]
    totals = engine.totals
    assert totals.prefill_steps >= 1 and totals.decode_steps >= 7
    assert totals.prefill_host_seconds == pytest.approx(0.25 * totals.prefill_steps)
    assert totals.decode_host_seconds == pytest.approx(0.25 * totals.decode_steps)



class RestartingRank(FakeRank):
    """A rank of two: answers from its first process until restart(), then as `timeline` says, by the
    seconds since restart() ((from, instance id); None: down, UNAVAILABLE, as while a process starts)."""

    def __init__(self, rank: int, first: str, timeline: list[tuple[float, str | None]]):
        super().__init__(rank, 2, 3, 0.0)
        self.first, self.timeline = first, timeline
        self.restarted: float | None = None

    def restart(self) -> None:
        self.restarted = time.monotonic()

    def Describe(self, request, context):
        instance = self.first
        if self.restarted is not None:
            instance = [i for at, i in self.timeline if time.monotonic() - self.restarted >= at][-1]
        if instance is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.instance_id = instance
        return info


def renewed_group_instances(ranks: list[RestartingRank]) -> list[str]:
    """Connects a group, renews it as after a failure, then connects the renewed one while the ranks
    go through their timelines: the process each rank was taken from."""
    servers, addresses = serve(ranks)

    async def fail_and_renew() -> list[str]:
        failed = WorkerGroup(addresses)
        await failed.connect(timeout=10)
        await failed.close()
        for rank in ranks:
            rank.restart()
        group = failed.renewed()
        try:
            await group.connect(timeout=10)
        finally:
            await group.close()
        return [info.instance_id for info in group.infos]

    try:
        return asyncio.run(fail_and_renew())
    finally:
        for server in servers:
            server.stop(0)


def test_a_renewed_group_waits_for_the_failed_groups_processes_to_restart():
    """Rank 0 is down while rank 1's process of the failed group still answers (it leaves that group a
    moment later): taken, that answer would leave rank 0's new process in its first collective waiting
    for a rank 1 nobody asks again. The renewed group waits for rank 1's new process too."""
    ranks = [RestartingRank(0, "old-0", [(0.0, None), (0.3, "new-0")]),
             RestartingRank(1, "old-1", [(0.0, "old-1"), (0.6, None), (0.9, "new-1")])]
    assert renewed_group_instances(ranks) == ["new-0", "new-1"]


def test_a_renewed_group_whose_processes_all_stayed_takes_them_again():
    """No rank went down (a step outlived --step-timeout, say): the failed group's processes serve on."""
    ranks = [RestartingRank(0, "old-0", [(0.0, "old-0")]), RestartingRank(1, "old-1", [(0.0, "old-1")])]
    assert renewed_group_instances(ranks) == ["old-0", "old-1"]


def test_an_idle_ping_finds_a_rank_restarted_since_the_last_one():
    """Between two pings rank 1 died and came back (its channel reconnects by itself): the ping names it
    restarted, for recovery to take the new process through the handshake, where before the group served
    on with a rank that holds none of its state."""
    ranks = [RestartingRank(0, "a-0", [(0.0, "a-0")]), RestartingRank(1, "a-1", [(0.0, "b-1")])]
    servers, addresses = serve(ranks)

    async def ping_twice() -> str:
        group = WorkerGroup(addresses)
        await group.connect(timeout=10)
        try:
            await group.ping()  # the same processes: nothing to say
            ranks[1].restart()
            with pytest.raises(WorkerUnavailable) as info:
                await group.ping()
            return str(info.value)
        finally:
            await group.close()

    try:
        restarted = f"worker rank 1 at {addresses[1]} restarted: another process answers at its address"
        assert asyncio.run(ping_twice()) == restarted
    finally:
        for server in servers:
            server.stop(0)
