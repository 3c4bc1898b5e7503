"""The engine loop: schedule -> step every rank -> post-process -> wake the request streams.

Runs as one asyncio task beside the gRPC handlers; handlers only submit requests and read
their RequestStream, so a slow client never blocks a step. Steps are pipelined as deep as the
workers keep them in flight (WorkerInfo.max_steps_in_flight, the smallest over the ranks): the
next steps are scheduled and sent before step N's tokens come back, so the workers always have
work queued and the GPU does not wait on this process or the network between steps, nor on a
late turn of this event loop.
"""
import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from nanoserve.v1 import worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.logprob_rows import prompt_logprobs, sampled_logprobs
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.recovery import CannotServe, GroupRecovery
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.request_table import RequestTable
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.step_plan import StepPlan
from scheduler_svc.step_totals import Totals
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable

if TYPE_CHECKING:  # type hints only: pyzmq is needed only when KV events are on
    from scheduler_svc.kv_event_publisher import KVEventPublisher

log = logging.getLogger("nanoserve.scheduler")


class Waker:
    """Wakes request streams a slice at a time. Woken all at once, a few hundred handlers would
    queue ahead of the engine's own callbacks (the workers' reply) and the GPU would wait for
    them; a slice at a time, the engine runs between slices. When the event loop is backed up
    (a slice's turn took longer than `max_lag`: handlers' writes completing, a garbage collection),
    the next slice waits as long again, so the engine's callbacks find a short queue: at 256
    streams the loop is saturated, and without the pause the engine's replies waited 10-30 ms and
    the GPU idled (bench/service_overhead.py --step-ms). A stream's tokens gather meanwhile and go
    out in one message, which is what lets the handlers catch up."""

    def __init__(self, slice_size: int = 16, max_lag: float = 1e-3):
        self.slice_size = slice_size
        self.max_lag = max_lag
        self.pending: dict[RequestStream, None] = {}  # an ordered set: first come, first woken
        self.has_pending = asyncio.Event()

    def wake_soon(self, streams: list[RequestStream]) -> None:
        """Queues the streams to be woken, each once, in a later slice."""
        self.pending.update(dict.fromkeys(streams))
        if self.pending:
            self.has_pending.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.has_pending.wait()
            self.has_pending.clear()
            while self.pending:
                for _ in range(min(self.slice_size, len(self.pending))):
                    stream = next(iter(self.pending))
                    del self.pending[stream]
                    stream.wakeup.set()
                started = loop.time()
                await asyncio.sleep(0)  # the woken handlers run, then whatever became ready meanwhile
                lag = loop.time() - started
                if lag > self.max_lag:  # backed up: let the queue drain before waking more
                    await asyncio.sleep(lag)


class Engine:
    """Drives one worker group: a loop that schedules steps, sends them to every rank, applies
    the tokens that come back and hands them to the request streams. Handlers submit sequences
    and abort them; both take effect between steps. When a rank fails, the requests are held
    while a fresh group connects, then recomputed (recovery.py); the loop ends only when no group
    can ever serve. With a KVEventPublisher, each step's prefix-cache changes are published."""

    def __init__(self, group: WorkerGroup, config: SchedulerConfig, restart_timeout: float,
                 kv_events: "KVEventPublisher | None" = None):
        self.group = group
        self.config = config
        self.kv_events = kv_events
        self.scheduler = Scheduler(config, kv_events.log if kv_events is not None else None)
        self.requests = RequestTable(self.scheduler)
        self.totals = Totals()
        self.metrics = SchedulerMetrics()
        self.metrics.watch(self.scheduler, self.totals)
        self.recovery = GroupRecovery(self.requests, self.scheduler, self.metrics, self.totals, group.infos[0],
                                      restart_timeout)
        if kv_events is not None:
            self.recovery.kv_dropped = kv_events.flush
        self.next_seq_id = 0
        self.task: asyncio.Task | None = None
        self.waker = Waker()
        self.waker_task: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.waker_task = loop.create_task(self.waker.run())
        self.task = loop.create_task(self._loop())
        self.task.add_done_callback(self._loop_ended)

    async def close(self) -> None:
        """Stops the loop and lets the workers go (their session ends with its step streams)."""
        for task in (self.task, self.waker_task):
            task.cancel()
        await asyncio.gather(self.task, self.waker_task, return_exceptions=True)
        await self.group.close()

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop that ends (no group can ever serve, or a bug) must not leave requests hanging:
        they fail, health goes down, and the scheduler exits (server.py)."""
        if task.cancelled():
            return
        error = task.exception()
        log.critical("the engine stopped: %s", error, exc_info=None if isinstance(error, CannotServe) else error)
        self.requests.end_all(f"the engine stopped: {error}")

    def submit(self, seq: Sequence, wakeup: asyncio.Event | None = None) -> RequestStream:
        """Queues a sequence for scheduling and returns the stream its tokens will arrive on
        (raises AdmissionError when it can never run); `wakeup`: one shared with other streams."""
        self.scheduler.enqueue(seq)
        stream = RequestStream(seq, wakeup=wakeup or asyncio.Event())
        self.requests.streams[seq.seq_id] = stream
        self.totals.prompt_tokens += len(seq.prompt_token_ids)
        self.requests.work.set()
        return stream

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def stop(self, seq: Sequence) -> None:
        """Finishes a sequence that its handler found a stop string in: it ends as stopped and
        its blocks are freed like an abort's (unless its last token had finished it already)."""
        if seq.seq_id in self.requests.streams:
            self.totals.requests_finished += 1
            self.requests.abort(seq.seq_id)
        seq.finish_reason = "stop"

    async def _loop(self) -> None:
        in_flight: deque[StepPlan] = deque()  # sent, in step order
        delivered: list[RequestStream] = []  # streams with new tokens, woken once the next step is out
        while True:
            if self.kv_events is not None:  # what the last round (or a recovery) did to the prefix cache
                self.kv_events.flush()
            self.requests.apply_aborts()
            depth = self.group.max_steps_in_flight  # the group is replaced after a failure
            plan = None
            if len(in_flight) < depth and self.scheduler.has_work():
                plan = self.scheduler.schedule()
            try:
                if plan is not None:
                    await self.group.send(plan)
                    in_flight.append(plan)
                    self.metrics.step_sent(plan, self.requests.streams, len(in_flight))
                # The handlers stream their tokens while the workers compute.
                self.waker.wake_soon(delivered)
                delivered = []
                if not in_flight:  # nothing runnable: wait for a change, watching the workers meanwhile
                    await self._idle()
                    continue
                if plan is not None and len(in_flight) < depth:
                    continue  # queue another step before waiting for this one
                done = in_flight.popleft()
                reply = await self.group.receive(done.step_id)
            except WorkerUnavailable as err:
                in_flight.clear()  # their tokens are dropped: recomputed, they come again
                self.waker.wake_soon(delivered)
                delivered = []
                self.group = await self.recovery.recover(self.group, str(err))
                continue
            self.totals.record_step(done, reply)
            self.metrics.steps_in_flight.set(len(in_flight))
            if done.scored:
                self._deliver_prompt_logprobs(done, reply.prompt_logprobs)
            if reply.HasField("sampled_logprobs"):  # first: _deliver drops a stream with its last token
                self._deliver_sampled_logprobs(done, reply.sampled_logprobs)
            delivered = [stream for seq in self.scheduler.postprocess(done, list(reply.token_ids))
                         if (stream := self._deliver(seq)) is not None]

    async def _idle(self, ping_every: float = 2.0) -> None:
        self.requests.work.clear()
        try:
            await asyncio.wait_for(self.requests.work.wait(), timeout=ping_every)
        except TimeoutError:
            await self.group.ping()

    def _deliver(self, seq: Sequence) -> RequestStream | None:
        """Hands a sequence's new token to its request stream (woken later by the loop)."""
        stream = self.requests.streams.get(seq.seq_id)
        if stream is None:
            return None
        stream.new_tokens.append(seq.completion_token_ids[-1])
        self.totals.generated_tokens += 1
        if seq.finish_reason is not None:
            stream.finished = True
            self.totals.requests_finished += 1
            del self.requests.streams[seq.seq_id]
        return stream

    def _deliver_sampled_logprobs(self, plan: StepPlan, rows: worker_pb2.LogprobRows) -> None:
        """Each sampled token's logprob row, to the stream its token goes to next (the streams of
        sequences that finished before the step are gone, as their tokens are dropped)."""
        for seq, row in sampled_logprobs(plan, rows).items():
            stream = self.requests.streams.get(seq.seq_id)
            if stream is not None and seq.status is not SequenceStatus.FINISHED:
                stream.new_logprobs.append(row)

    def _deliver_prompt_logprobs(self, plan: StepPlan, rows: worker_pb2.LogprobRows) -> None:
        """Appends each scored entry's rows to its stream, from the position the stream has
        reached (a recompute after preemption may score positions again)."""
        for index, entry_rows in zip(plan.scored, prompt_logprobs(plan, rows)):
            stream = self.requests.streams.get(plan.seqs[index].seq_id)
            if stream is not None:
                skip = len(stream.prompt_logprobs) - plan.num_computed[index]
                stream.prompt_logprobs.extend(entry_rows[max(0, skip):])
