"""The scheduler's view of its worker ranks: connect, agree on a KV pool, stream steps to all.
The transport: the only part of the scheduler that puts steps on the wire (step_encoder.py)."""
import asyncio
import logging
import secrets
import time

import grpc

from nanoserve.tls import TLSFiles, open_aio_channel
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import GRPC_OPTIONS, SESSION_KEY, STEP_FORMAT, TOKEN_KEY, TOKEN_SCHEME
from scheduler_svc.step_encoder import encode_step
from scheduler_svc.step_plan import StepPlan

log = logging.getLogger("nanoserve.scheduler")

# How often a rank that is not serving yet is asked again: a restarted rank is taken within this of
# its load ending (a loading rank answers UNAVAILABLE at once, so asking costs it nothing).
HANDSHAKE_POLL_SECONDS = 0.2
# A channel to a rank that refused connections (restarting) waits this long before it tries again;
# gRPC's default backoff grows from 1 s to 120 s, and a restarted rank waited seconds to be seen.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 200)]


class WorkerUnavailable(Exception):
    """A rank could not be reached, failed a step or hung; the message names it. `final`: it
    refused this scheduler in a way that waiting will not change (a wrong token, a foreign group)."""

    def __init__(self, message: str, final: bool = False):
        super().__init__(message)
        self.final = final


# Answers that waiting will not change: a wrong or missing --worker-token, a port that is no worker.
_FINAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


class WorkerGroup:
    """The worker ranks of one deployment, one address each, rank order. connect() shakes hands
    with every rank and settles what they must agree on (the KV pool, the steps in flight); then
    send() puts a step plan on every rank's step stream and receive() collects their replies,
    in step order. Any rank failing raises WorkerUnavailable naming it; the group is then spent
    and the engine builds a new one (renewed()).

    Each group is one session on its workers (a random id sent with the handshake and the step
    streams): a worker serving another scheduler's live session refuses it (FAILED_PRECONDITION).
    With a token every call carries it; with TLS files the channels are TLS. A step whose replies
    take longer than `step_timeout` seconds counts as a failure of the ranks that did not answer:
    they are hung."""

    def __init__(self, addresses: list[str], token: str = "", tls: TLSFiles = TLSFiles(),
                 step_timeout: float | None = None, kv_offer: tuple[int, list[str]] | None = None,
                 failed_instances: frozenset[str] = frozenset()):
        self.addresses = addresses
        self.token, self.tls = token, tls
        self.step_timeout = step_timeout
        self.kv_offer = kv_offer  # (blocks, each rank's kv_sizing) a previous group served with
        # The processes of the failed group of several ranks this one follows: once one of its ranks is
        # seen down or restarted, the others leave that group too, and their answers meanwhile are not
        # taken (a restarted rank sizing its KV cache waits in a collective for its peers' restarts).
        self.failed_instances = failed_instances
        self.stale_ranks: set[int] = set()  # ranks that answered from one of those processes
        self.restarting = False  # a rank was seen down or restarted: the failed group is not whole
        self.session_id = secrets.token_hex(16)
        self.metadata = ((SESSION_KEY, self.session_id),) + (((TOKEN_KEY, TOKEN_SCHEME + token),) if token else ())
        self.channels = [open_aio_channel(a, tls, options=GRPC_OPTIONS + RECONNECT_OPTIONS) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.infos: list[worker_pb2.WorkerInfo] = []
        self.streams: list = []
        self.num_blocks = 0
        self.max_steps_in_flight = 0  # the smallest any rank reports: steps sent ahead of the replies

    def renewed(self, offer_kv_pool: bool = False) -> "WorkerGroup":
        """A new group (and session) on the same workers, for after this one failed; with
        offer_kv_pool, it offers restarted ranks this group's KV pool (they take it where their
        configuration is unchanged instead of measuring memory again; the pool keeps its shape)."""
        offer = (self.num_blocks, [info.kv_sizing for info in self.infos]) if offer_kv_pool and self.infos else None
        failed = frozenset(info.instance_id for info in self.infos) if len(self.infos) > 1 else frozenset()
        return WorkerGroup(self.addresses, self.token, self.tls, self.step_timeout, offer, failed - {""})

    def name(self, rank: int) -> str:
        return f"worker rank {rank} at {self.addresses[rank]}"

    async def connect(self, timeout: float) -> None:
        """Waits for every rank, checks they form one deployment, allocates the agreed KV pool."""
        # All ranks at once: a rank may only answer once its whole group has met.
        self.infos = await self._on_every_rank(lambda rank: self._describe(rank, timeout))
        self._check_agreement()
        self.num_blocks = min(info.max_kv_blocks for info in self.infos)
        self.max_steps_in_flight = min(info.max_steps_in_flight for info in self.infos)
        # Together too: on a GPU each rank's graph capture runs collectives with the others.
        await self._on_every_rank(self._allocate)
        self.streams = await self._on_every_rank(self._open_step_stream)
        log.info("connected to %d worker rank(s); KV pool %d blocks of %d tokens; %d steps in flight",
                 len(self.stubs), self.num_blocks, self.infos[0].block_size, self.max_steps_in_flight)

    async def _on_every_rank(self, call) -> list:
        """call(rank) on all ranks concurrently; every rank that failed is named in one error."""
        results = await asyncio.gather(*(call(rank) for rank in range(len(self.stubs))), return_exceptions=True)
        failed = [str(r) for r in results if isinstance(r, WorkerUnavailable)]
        if failed:
            raise WorkerUnavailable("; ".join(failed))
        unexpected = next((r for r in results if isinstance(r, BaseException)), None)
        if unexpected is not None:
            raise unexpected
        return results

    async def _open_step_stream(self, rank: int):
        """Opened now, not at the first step: an open stream is what keeps this session on the worker."""
        stream = self.stubs[rank].Step(metadata=self.metadata)
        try:
            await stream.wait_for_connection()
        except grpc.aio.AioRpcError as err:
            raise WorkerUnavailable(f"{self.name(rank)} refused the step stream: {err.details()}") from err
        return stream

    async def _allocate(self, rank: int) -> None:
        try:
            await self.stubs[rank].AllocateKVCache(worker_pb2.AllocateKVCacheRequest(num_blocks=self.num_blocks),
                                                   metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # another scheduler's session holds it
                raise WorkerUnavailable(f"{self.name(rank)} refused this scheduler: {err.details()}") from err
            raise WorkerUnavailable(f"{self.name(rank)} failed to allocate its KV cache: {err.details()}") from err

    async def _describe(self, rank: int, timeout: float) -> worker_pb2.WorkerInfo:
        """The rank's answer once it has loaded; its first answer may take a forward pass (sizing its KV room)."""
        deadline = time.monotonic() + timeout
        next_log = 0.0
        request = worker_pb2.DescribeRequest()
        if self.kv_offer is not None:
            request.num_kv_blocks, request.kv_sizing = self.kv_offer[0], self.kv_offer[1][rank]
        while True:
            try:
                info = await self.stubs[rank].Describe(request, timeout=max(1.0, deadline - time.monotonic()),
                                                       metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                self.restarting = True
                if err.code() in _FINAL_CODES:
                    raise WorkerUnavailable(f"{self.name(rank)} refused the handshake: {err.code().name}: "
                                            f"{err.details()}", final=True) from err
                late, waiting, cause = (f"did not answer within {timeout:.0f}s: {err.code().name}",
                                        f"({err.code().name}: {err.details()})", err)
            else:
                if info.instance_id not in self.failed_instances:
                    self.restarting = self.restarting or bool(self.failed_instances)
                    return info
                self.stale_ranks.add(rank)
                if not self.restarting and len(self.stale_ranks) == len(self.stubs):
                    return info  # every rank is still the failed group's process: no rank died, the group is whole
                late = f"did not restart within {timeout:.0f}s: it still answers from the failed group's process"
                waiting, cause = "to restart: it answers from the failed group's process", None
            now = time.monotonic()
            if now >= deadline:
                raise WorkerUnavailable(f"{self.name(rank)} {late}") from cause
            if now >= next_log:
                log.info("waiting for %s %s", self.name(rank), waiting)
                next_log = now + 10
            await asyncio.sleep(HANDSHAKE_POLL_SECONDS)

    def _check_agreement(self) -> None:
        first = self.infos[0]
        for rank, info in enumerate(self.infos):
            if info.max_steps_in_flight == 0:  # a field older workers do not send
                raise WorkerUnavailable(f"{self.name(rank)} reports no steps in flight (max_steps_in_flight 0): "
                                        "it is too old for this scheduler or incompatible; run workers of the "
                                        "same nanoserve version")
            if info.step_format != STEP_FORMAT:
                raise WorkerUnavailable(f"{self.name(rank)} reads step format {info.step_format}, this scheduler "
                                        f"writes {STEP_FORMAT}: run workers of the same nanoserve version",
                                        final=True)
            problems = []
            if info.rank != rank:
                problems.append(f"reports rank {info.rank}")
            if info.world_size != len(self.infos):
                problems.append(f"expects {info.world_size} ranks, the scheduler has {len(self.infos)}")
            if info.model_fingerprint != first.model_fingerprint:
                problems.append(f"serves {info.model!r}, rank 0 serves {first.model!r}")
            if info.block_size != first.block_size:
                problems.append(f"uses block size {info.block_size}, rank 0 uses {first.block_size}")
            if problems:
                raise WorkerUnavailable(f"{self.name(rank)} does not match the group: " + "; ".join(problems),
                                        final=True)

    async def send(self, plan: StepPlan) -> None:
        """Sends one step to every rank; `receive` collects the replies."""
        request = encode_step(plan)
        # Each write its own outcome: a failed rank is named, and its peers' errors are not left unretrieved.
        writes = await asyncio.gather(*(s.write(request) for s in self.streams), return_exceptions=True)
        for rank, outcome in enumerate(writes):
            if isinstance(outcome, BaseException):
                raise await self._stream_failed(rank, outcome)

    async def receive(self, step_id: int) -> worker_pb2.StepResponse:
        """Every rank's reply to the step sent last; returns rank 0's (its tokens and timings)."""
        reads = [asyncio.ensure_future(s.read()) for s in self.streams]
        try:
            await asyncio.wait(reads, timeout=self.step_timeout, return_when=asyncio.FIRST_EXCEPTION)
            # A failed rank first: the ranks still waiting may only be waiting for it.
            for rank, read in enumerate(reads):
                if read.done() and (read.cancelled() or read.exception() is not None):
                    raise await self._stream_failed(rank, _outcome(read))
            hung = [rank for rank, read in enumerate(reads) if not read.done()]
            if hung:
                raise WorkerUnavailable(", ".join(map(self.name, hung)) + f" did not answer step {step_id} within "
                                        f"{self.step_timeout:g}s (--step-timeout): treated as hung")
        finally:
            for read in reads:
                read.cancel()
        for rank, read in enumerate(reads):
            reply = read.result()
            if reply is grpc.aio.EOF:
                raise WorkerUnavailable(f"{self.name(rank)} closed its step stream")
            if reply.error:
                raise WorkerUnavailable(f"{self.name(rank)} failed step {step_id}: {reply.error}")
        return reads[0].result()

    async def ping(self, timeout: float = 10.0) -> None:
        """Raises WorkerUnavailable when a rank no longer answers (checked while idle), or answers from
        another process than the one this group connected to: a rank that died and came back between two
        pings (its channel reconnects by itself) holds none of this group's state, not even its KV cache,
        and may serve another model. A dead rank fails at once (its connection is refused); the timeout
        only bounds a rank that is connected but silent, and is generous: on a loaded machine an idle
        worker can take seconds to be scheduled, and a 2 s bound sent healthy groups through recovery."""
        for rank, stub in enumerate(self.stubs):
            try:
                info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                raise WorkerUnavailable(f"{self.name(rank)} is unavailable: {err.code().name}") from err
            if info.instance_id != self.infos[rank].instance_id:
                raise WorkerUnavailable(f"{self.name(rank)} restarted: another process answers at its address")

    async def _stream_failed(self, rank: int, error: BaseException) -> WorkerUnavailable:
        """The rank's step stream failed. Every way a call can end is a failure of the rank, not of
        the engine: besides AioRpcError, a write on an ended call raises InvalidStateError ("RPC
        already finished") and a read of a cancelled one CancelledError; both name the call's own
        status, the reason it ended. Anything else is a bug of this process and is raised as is."""
        stream = self.streams[rank]
        if isinstance(error, grpc.aio.AioRpcError):
            why = error.details() or error.code().name
        elif isinstance(error, (asyncio.InvalidStateError, asyncio.CancelledError)) and stream.done():
            why = await stream.details() or (await stream.code()).name  # at once: the call is done
        else:
            raise error
        unavailable = WorkerUnavailable(f"{self.name(rank)} is unavailable: {why}")
        unavailable.__cause__ = error
        return unavailable

    async def close(self) -> None:
        for stream in self.streams:
            stream.cancel()
        for channel in self.channels:
            await channel.close()


def _outcome(task: asyncio.Future) -> BaseException:
    """The exception a failed task ended with; a cancelled one's as the CancelledError it raised."""
    return asyncio.CancelledError() if task.cancelled() else task.exception()
