"""The gateway's own HTTP metrics: requests by path and status, their duration, those in progress.

A plain ASGI middleware (no per-chunk work on streamed bodies): it notes the status when the
response starts and observes the duration when the response has been sent in full.

With several gateway processes (--api-server-count) PROMETHEUS_MULTIPROC_DIR is set before any of
them imports prometheus_client, which then keeps every value in a file of that folder per process;
/metrics, whichever process answers it, adds up all the files: the counters and histograms of every
process that ever served (one replaced after dying included), the in-progress gauge of the live ones.
"""
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HTTPMetrics:
    """ASGI middleware counting every HTTP request; paths outside `paths` count as "other"."""

    def __init__(self, app, registry: CollectorRegistry, paths: set[str]):
        self.app = app
        self.paths = paths
        self.requests = Counter("nanoserve_gateway_http_requests", "HTTP requests answered",
                                ["method", "path", "status"], registry=registry)
        self.duration = Histogram("nanoserve_gateway_http_request_duration_seconds",
                                  "Request received to response sent in full (streams included)",
                                  ["method", "path"], buckets=_BUCKETS, registry=registry)
        self.in_progress = Gauge("nanoserve_gateway_http_requests_in_progress", "HTTP requests being answered",
                                 registry=registry, multiprocess_mode="livesum")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        path = scope["path"] if scope["path"] in self.paths else "other"
        status = 500  # what the client sees when the app fails before answering

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.in_progress.inc()
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.in_progress.dec()
            self.requests.labels(scope["method"], path, str(status)).inc()
            self.duration.labels(scope["method"], path).observe(time.perf_counter() - started)


def exposition(registry: CollectorRegistry) -> bytes:
    """What /metrics answers: this process's registry, or with several processes all of theirs."""
    folder = os.environ.get(MULTIPROC_DIR_ENV)
    if not folder:
        return generate_latest(registry)
    _forget_dead_processes(folder)
    every = CollectorRegistry()
    MultiProcessCollector(every, folder)
    return generate_latest(every)


def _forget_dead_processes(folder: str) -> None:
    """Drops the live gauges of processes gone (one that died mid-request left its count behind)."""
    for path in Path(folder).glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, folder)
        except PermissionError:  # alive, another user's: the pid was reused
            pass
