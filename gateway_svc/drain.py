"""How a gateway process stops: the first SIGINT or SIGTERM drains it, a second stops it at once.

Draining, every request but /metrics is answered 503 (nanoserve.stopping.DRAINING; /health too, so a
router stops sending here and retries elsewhere) while the requests in flight finish, for up to
--shutdown-timeout seconds. What is left then ends: a stream with an OpenAI-shaped error event and
[DONE], a whole response with a 503, both saying SHUTTING_DOWN. Then uvicorn is let go on with its
own stop.

uvicorn takes the signals first (signal.signal, in its Server.capture_signals); the app's lifespan,
which starts inside that, puts `listen` in front and hands uvicorn the signal once the drain is done.
"""
import asyncio
import json
import logging
import signal
from collections.abc import Callable

from gateway_svc.errors import OpenAIError
from gateway_svc.responses import DONE, event
from nanoserve.stopping import DRAINING, SHUTTING_DOWN

log = logging.getLogger("nanoserve.gateway")
_ALWAYS_SERVED = "/metrics"  # a draining process still shows what it is doing
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Drain:
    """The process's stop, and the HTTP requests in flight it waits for (an ASGI middleware)."""

    def __init__(self, app, timeout: float):
        self.app = app
        self.timeout = timeout
        self.draining = False
        self.in_flight: set[asyncio.Task] = set()
        self.cut_off: set[asyncio.Task] = set()  # cancelled by the drain's end, not by their client
        self.idle = asyncio.Event()
        self.at_once = asyncio.Event()
        self.idle.set()

    def listen(self) -> None:
        """Takes SIGINT and SIGTERM from uvicorn's handler, which gets them back after the drain."""
        loop = asyncio.get_running_loop()
        uvicorn_handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}

        def signalled(signum, frame) -> None:
            if self.draining:
                loop.call_soon_threadsafe(self.at_once.set)
            else:
                self.draining = True
                loop.call_soon_threadsafe(loop.create_task, self._drain(uvicorn_handlers[signum], signum))

        for sig in _SIGNALS:
            signal.signal(sig, signalled)

    async def _drain(self, uvicorn_handler: Callable, signum: int) -> None:
        log.info("stopping: /health answers 503 and new requests are refused; %d request(s) in flight may finish "
                 "within %gs (--shutdown-timeout); a second Ctrl-C or SIGTERM stops at once", len(self.in_flight),
                 self.timeout)
        waits = [asyncio.ensure_future(self.idle.wait()), asyncio.ensure_future(self.at_once.wait())]
        await asyncio.wait(waits, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self.in_flight:
            log.info("ending %d request(s) still in flight: %s", len(self.in_flight), SHUTTING_DOWN)
            self.cut_off |= self.in_flight
            for task in self.in_flight:
                task.cancel()
            await self.idle.wait()
        uvicorn_handler(signum, None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == _ALWAYS_SERVED:
            return await self.app(scope, receive, send)
        if self.draining:
            return await _answer(send, 503, DRAINING)
        response = _Response(send)
        task = asyncio.current_task()
        self.in_flight.add(task)
        self.idle.clear()
        try:
            await self.app(scope, receive, response.send)
        except asyncio.CancelledError:
            if task not in self.cut_off:
                raise
            task.uncancel()
            await response.end(SHUTTING_DOWN)
        finally:
            self.in_flight.discard(task)
            self.cut_off.discard(task)
            if not self.in_flight:
                self.idle.set()


class _Response:
    """What a request has sent so far, so the drain can end it in the shape it began."""

    def __init__(self, send):
        self._send = send
        self.started = False
        self.streaming = False
        self.ended = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.streaming = any(name == b"content-type" and value.startswith(b"text/event-stream")
                                 for name, value in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def end(self, message: str) -> None:
        if not self.started:
            await _answer(self._send, 503, message)
        elif not self.ended:
            tail = event(_error(message)) + DONE if self.streaming else b""
            await self._send({"type": "http.response.body", "body": tail, "more_body": False})


def _error(message: str) -> dict:
    return OpenAIError(503, message, code="unavailable").body()


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps(_error(message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
