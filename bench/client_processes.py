"""The online benchmark's client spread over several processes (bench/serve.py --client-processes N).

One Python process takes some tens of thousands of streamed messages a second (~15-20 us of CPU each
on an AMD EPYC core: socket read, SSE line, JSON, timing); past that the client, not the server, sets
the pace and stretches every latency it measures. Here each process has its own event loop and its
own target (HTTP session or gRPC channel); request i of a run goes to process i % N at its own arrival
time on one schedule shared by all (perf_counter is the host's monotonic clock, the same in every
process), and the results come back in request order, so the merged run is the one a single client
would have sent. Each process also reports the CPU seconds it spent on the run: a process near one
CPU second per second was the limit.
"""
import asyncio
import contextlib
import functools
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable

# (target, requests, arrival times, start, max concurrency) -> (results in request order, when the last ended)
RunSchedule = Callable[[Any, list, list[float], float, int], Awaitable[tuple[list, float]]]


@dataclass
class ClientShare:
    """What one process measured of a run: its requests' results, when its last one ended
    (perf_counter) and the CPU seconds the process spent from receiving its share to the end."""
    results: list
    end: float
    cpu_seconds: float


class ClientProcesses:
    """`count` client processes, started once and reused for every run (warm-up included), so their
    connections are open before the timed runs as a single client's are."""

    def __init__(self, count: int, open_target: Callable[[int], Any], run_schedule: RunSchedule):
        """open_target(index) (picklable: a module-level function or a partial of one) makes the target of
        process `index`; run_schedule times its share of a run. Both run in the child processes."""
        context = multiprocessing.get_context("spawn")  # forking a process that runs gRPC threads is unsafe
        self.pipes: list[Connection] = []
        self.processes = []
        for index in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, functools.partial(open_target, index), run_schedule),
                                      daemon=True)
            process.start()
            theirs.close()  # so that a process that dies is an EOFError on our end, not a hang
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            pipe.recv()  # its target is open

    async def run(self, requests: list, times: list[float],
                  max_concurrency: int = 0) -> tuple[list, float, list[float]]:
        """Every request sent at its time after one common start (at most max_concurrency in flight
        over all processes, split evenly; 0 = no limit): the results in request order, the seconds
        from the start to the last completion in any process, and each process's CPU seconds."""
        count = len(self.pipes)
        for index, pipe in enumerate(self.pipes):
            pipe.send((requests[index::count], times[index::count], max_concurrency // count))
        await self._gather_replies()  # every process holds its share: none starts late
        start = time.perf_counter()
        for pipe in self.pipes:
            pipe.send(start)
        shares: list[ClientShare] = await self._gather_replies()
        results = [None] * len(requests)
        for index, share in enumerate(shares):
            results[index::count] = share.results
        return results, max(share.end for share in shares) - start, [share.cpu_seconds for share in shares]

    async def _gather_replies(self) -> list:
        return await asyncio.gather(*(asyncio.to_thread(pipe.recv) for pipe in self.pipes))

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # a process that died has said why on stderr already
                pipe.send(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()


def _serve(pipe: Connection, open_target: Callable[[], Any], run_schedule: RunSchedule) -> None:
    """A client process: opens its target on its own event loop, then runs each share it is sent,
    from the start time sent after it, until told to stop (None)."""
    loop = asyncio.new_event_loop()
    target = loop.run_until_complete(_opened(open_target))
    pipe.send(None)
    try:
        while (job := pipe.recv()) is not None:
            requests, times, max_concurrency = job
            cpu = time.process_time()
            pipe.send(None)
            start = pipe.recv()
            results, end = loop.run_until_complete(run_schedule(target, requests, times, start, max_concurrency))
            pipe.send(ClientShare(results, end, time.process_time() - cpu))
    finally:
        loop.run_until_complete(target.close())
        loop.close()


async def _opened(open_target: Callable[[], Any]) -> Any:
    """The target, made on the running loop (a gRPC channel binds to it) and described (an OpenAI
    target learns the model name every request carries)."""
    target = open_target()
    await target.describe()
    return target
