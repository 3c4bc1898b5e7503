"""How the scheduler stops: the first SIGINT or SIGTERM drains it, a second stops it at once.

Draining, the scheduler reports NOT_SERVING (ServingHealth) and refuses new Generate and Chat calls
(UNAVAILABLE, nanoserve.stopping.DRAINING, so a router retries them elsewhere: DrainGuard) while the
calls in flight finish, for up to --shutdown-timeout seconds; what is left then ends UNAVAILABLE
(SHUTTING_DOWN).
"""
import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoserve.healthcheck import LIVENESS
from nanoserve.race import Interrupted, unless
from nanoserve.stopping import DRAINING, SHUTTING_DOWN

log = logging.getLogger("nanoserve.scheduler")

T = TypeVar("T")
_GENERATION = frozenset({"/nanoserve.v1.LLM/Generate", "/nanoserve.v1.LLM/Chat"})  # the calls a drain waits for


class Stopped(Exception):
    """A stop was asked for before the awaited start-up step finished."""


class Shutdown:
    """The stop signals, and the generation calls in flight that a drain waits for."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.asked = asyncio.Event()    # the first signal: drain
        self.at_once = asyncio.Event()  # the second: stop now
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def listen(self) -> None:
        """Takes SIGINT and SIGTERM from now on (no KeyboardInterrupt, no traceback)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signalled)

    def _signalled(self) -> None:
        (self.at_once if self.asked.is_set() else self.asked).set()

    @property
    def draining(self) -> bool:
        return self.asked.is_set()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Counts one generation call in flight while the block runs."""
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    async def unless_asked(self, work: Awaitable[T]) -> T:
        """`work`'s result, or Stopped (the work cancelled) when a stop is asked for first."""
        try:
            return await unless(work, self.asked.wait())
        except Interrupted:
            raise Stopped() from None

    async def asked_before(self, task: asyncio.Future) -> bool:
        """Waits for the first stop signal or for `task` to end; True when the signal came first."""
        asked = asyncio.ensure_future(self.asked.wait())
        await asyncio.wait((asked, task), return_when=asyncio.FIRST_COMPLETED)
        signalled = asked.done()
        asked.cancel()
        return signalled

    async def drain(self, health: "ServingHealth", give_up: Callable[[str], None]) -> None:
        """Lets the generation calls in flight finish (new ones are refused meanwhile), within the
        timeout; then ends the rest UNAVAILABLE through `give_up`."""
        await health.set(False)
        log.info("stopping: NOT_SERVING and refusing new requests; %d request(s) in flight may finish within %gs "
                 "(--shutdown-timeout); a second Ctrl-C or SIGTERM stops at once", self.in_flight, self.timeout)
        if await self.drained():
            log.info("every request in flight finished")
            return
        log.info("ending %d request(s) still in flight: %s", self.in_flight, SHUTTING_DOWN)
        give_up(SHUTTING_DOWN)

    async def drained(self) -> bool:
        """Waits for the calls in flight to end, up to the timeout or a second signal; True when they all did."""
        waits = [asyncio.ensure_future(self.idle.wait()), asyncio.ensure_future(self.at_once.wait())]
        try:
            await asyncio.wait(waits, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self.idle.is_set()


class DrainGuard(grpc.aio.ServerInterceptor):
    """In front of Generate and Chat: refuses a new call while the server drains, counts it in flight
    otherwise (the other calls are cheap and keep answering: a drain is watched with GetStats)."""

    def __init__(self, shutdown: Shutdown):
        self.shutdown = shutdown

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method not in _GENERATION:
            return handler
        shutdown, behavior = self.shutdown, handler.unary_stream

        async def counted(request, context) -> None:
            if shutdown.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            with shutdown.call():
                await behavior(request, context)

        return grpc.unary_stream_rpc_method_handler(counted, handler.request_deserializer,
                                                    handler.response_serializer)


class ServingHealth:
    """The server's grpc.health.v1 answers: LIVENESS SERVING from start-up on; the whole server ("")
    and the LLM service SERVING only while a worker group serves and no drain has begun (a recovered
    group does not bring a draining server back)."""

    def __init__(self, server: grpc.aio.Server, service_name: str, shutdown: Shutdown):
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.names = ("", service_name)
        self.shutdown = shutdown

    async def start(self) -> None:
        """Alive, not serving yet (the workers are not connected)."""
        await self.set(False)
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)

    async def set(self, healthy: bool) -> None:
        serving = healthy and not self.shutdown.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.servicer.set(name, status)
