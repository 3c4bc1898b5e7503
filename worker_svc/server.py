"""The Worker gRPC service: one process per tensor-parallel rank, around a ModelRunner."""
import logging
import queue
import secrets
import sys
import threading
from concurrent import futures
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoserve.gc_freeze import freeze_start_up_objects
from nanoserve.listen import ListenError, listen
from nanoserve.step_rows import num_rows
from nanoserve.tls import TLSConfigError, TLSFiles
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import SERVER_OPTIONS
from worker_svc.config import WorkerConfig
from worker_svc.distributed import GroupError, exit_broken_rank, init_distributed
from worker_svc.guard import WorkerGuard
from worker_svc.launched_step import MAX_STEPS_IN_FLIGHT, LaunchedStep, RefusedStep
from worker_svc.preflight import StartupError, check_startup
from worker_svc.sessions import Sessions
from worker_svc.startup_phases import StartupPhases
from worker_svc.stopping import StoppedWhileLoading, WorkerStop
from worker_svc.watchdog import StepWatchdog

log = logging.getLogger("nanoserve.worker")
# How long a thread may hold the GIL while another waits (Python's default: 5 ms). The step launcher
# runs ~1 ms of Python a batch-1 step while the reply thread waits to send a finished step's tokens;
# with a null device of 1 ms steps and 0.9 ms launches, 0.2 ms took a batch-1 stream from 790 to 865
# tokens/s on a 2-core machine (the scheduler's next step waits for that reply).
GIL_SWITCH_SECONDS = 2e-4
INSTANCE_ID = secrets.token_hex(8)  # this process's, in every WorkerInfo it gives


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """The Worker API over one runner. The port is served while the model loads (runner None):
    every call then answers UNAVAILABLE, so a scheduler waits and a second server on the port fails.
    With a step timeout, a step that does not finish within it ends the process (watchdog.py)."""

    def __init__(self, runner=None, step_timeout: float | None = None):
        self.runner = runner
        self.watchdog = StepWatchdog(step_timeout) if step_timeout else None
        self.lock = threading.Lock()  # the runner is driven by one request at a time
        self.depth = MAX_STEPS_IN_FLIGHT

    def _require_runner(self, context) -> None:
        if self.runner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "loading: this worker is still loading its model")

    def Describe(self, request, context) -> worker_pb2.WorkerInfo:
        self._require_runner(context)
        if not self.runner.kv_sized:
            with self.lock:  # the first one sizes the KV room, which may take a forward pass
                self._size_kv_cache(request)
        info = self.runner.info()
        info.max_steps_in_flight = self.depth
        info.instance_id = INSTANCE_ID
        return info

    def _size_kv_cache(self, request: worker_pb2.DescribeRequest) -> None:
        """Once: takes the offered pool where it was sized for this rank's configuration, else
        measures; a rank with no room for a KV cache cannot serve and exits, saying why."""
        runner = self.runner
        if runner.kv_sized:
            return
        runner.phases.end("handshake")  # serving, until a scheduler asked
        try:
            runner.size_kv_cache(request.num_kv_blocks if request.kv_sizing == runner.kv_sizing else 0)
        except Exception as err:  # no room for it; on CUDA, the measuring forward's collectives or device
            exit_broken_rank(f"rank {runner.config.rank} cannot serve {runner.config.model}: {err}")

    def AllocateKVCache(self, request, context) -> worker_pb2.AllocateKVCacheResponse:
        self._require_runner(context)
        with self.lock:
            try:
                self.runner.allocate_kv_cache(request.num_blocks)
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except Exception as err:  # on CUDA, graph capture runs collectives too
                exit_broken_rank(f"allocating the KV cache failed: {err!r}")
        freeze_start_up_objects()  # the model, its compiled kernels and graphs: nothing a collection need walk
        log.info("KV cache allocated: %d blocks", request.num_blocks)
        self.runner.phases.log_ready(log, self.runner.config.rank)
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests: Iterator[worker_pb2.StepRequest], context) -> Iterator[worker_pb2.StepResponse]:
        """Replies in order, one per request, each as soon as its device work is done. Steps are
        launched on a thread of their own as they arrive (the scheduler sends step N+1 before it has
        step N's tokens), so the device is kept busy, and a reply never waits behind a later step's
        launch: with both on one thread, each step's round trip through the scheduler came after the
        next launch's host time (~1 ms at batch 1), and batch-1 decode ran at host time + round trip
        a token, not at the device's pace."""
        self._require_runner(context)
        log.info("step stream opened by %s", context.peer())
        launched: queue.SimpleQueue = queue.SimpleQueue()  # (step id, step, debug summary), then _END
        threading.Thread(target=self._launch_each, args=(requests, launched), name="step-launcher",
                         daemon=True).start()
        try:
            while (item := launched.get()) is not _END:
                yield self._reply(*item)
                item[1].after_reply()  # gRPC asks for the next reply once this one is sent
        finally:  # the client left: finish the device work, reply to no one
            while item is not _END:
                item = launched.get()
                if item is not _END:
                    self._reply(*item)
                    item[1].after_reply()
        log.info("step stream closed")

    def _launch_each(self, requests: Iterator[worker_pb2.StepRequest], launched: queue.SimpleQueue) -> None:
        try:
            for request in requests:
                step = self._launch(request)
                if self.watchdog is not None:
                    self.watchdog.launched(step, request.step_id)
                launched.put((request.step_id, step, _summary(request) if log.isEnabledFor(logging.DEBUG) else ""))
        except Exception:  # the stream broke (client gone): what was launched is still replied to
            pass
        launched.put(_END)

    def _launch(self, request: worker_pb2.StepRequest) -> LaunchedStep | RefusedStep:
        with self.lock:
            try:
                return self.runner.launch(request)
            except ValueError as err:  # a bad step: report it, keep serving
                log.warning("step %d refused: %s", request.step_id, err)
                return RefusedStep(str(err))
            except Exception as err:  # a collective whose peer is gone, a device fault: unrecoverable
                exit_broken_rank(f"step {request.step_id} failed: {err!r}")

    def _reply(self, step_id: int, step: LaunchedStep | RefusedStep, summary: str = "") -> worker_pb2.StepResponse:
        try:
            reply = step.reply(step_id)
        except Exception as err:  # a device fault surfaces when the step's work is waited for
            exit_broken_rank(f"step {step_id} failed: {err!r}")
        if self.watchdog is not None:
            self.watchdog.answered(step)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d (%s): host %.2f ms, device busy %.2f ms, idle %.2f ms before it", step_id,
                      summary, 1e3 * reply.host_seconds, 1e3 * reply.busy_seconds,
                      1e3 * reply.idle_seconds)
        return reply


def _summary(request: worker_pb2.StepRequest) -> str:
    """What a step computes, for the debug log: sequences, how many of them decode, tokens."""
    counts = request.num_token_ids[:]
    decodes = counts.count(0) + counts.count(1)
    return f"{len(counts)} seqs, {decodes} decoding, {num_rows(counts)} tokens"


_END = object()


def serve_worker(config: WorkerConfig, host: str, port: int, tls: TLSFiles = TLSFiles(),
                 token: str = "", shutdown_timeout: float = 0.0, phases: StartupPhases | None = None) -> int:
    """Takes the port first (a busy one fails before anything loads), answers UNAVAILABLE while the
    model loads, then serves until stopped (stopping.py); returns the exit status."""
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    stop = WorkerStop(shutdown_timeout)
    sessions = Sessions()
    try:
        check_startup(config)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS,
                             interceptors=[WorkerGuard(token, sessions)])
        address = listen(server, host, port, f"worker rank {config.rank}'s --port", tls.server_credentials())
    except (StartupError, ListenError, TLSConfigError) as err:
        log.error("cannot start: %s", err)
        return 1
    service = WorkerService(step_timeout=config.step_timeout)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("rank %d listening on %s%s while it loads", config.rank, address, " (TLS)" if tls.enabled else "")
    try:
        service.runner = _load(config, phases or StartupPhases())
    except (StartupError, StoppedWhileLoading) as err:
        server.stop(grace=0).wait()
        if isinstance(err, StoppedWhileLoading):
            log.info("rank %d stopped while loading", config.rank)
            return 0
        log.error("rank %d cannot serve %s: %s", config.rank, config.model, err)
        return 1
    _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    log.info("rank %d serving on %s", config.rank, address)
    stop.wait_asked()
    _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    if sessions.held():
        log.info("rank %d stopping once its scheduler lets go (it drains within --shutdown-timeout %gs)",
                 config.rank, shutdown_timeout)
        if not stop.wait_released(sessions.held):
            log.info("rank %d stopping with its scheduler's session still open", config.rank)
    server.stop(grace=1).wait()
    log.info("rank %d stopped", config.rank)
    return 0


def _load(config: WorkerConfig, phases: StartupPhases):
    from worker_svc.runner import ModelRunner

    phases.end("imports")
    try:
        init_distributed(config)
        log.info("rank %d/%d loading %s", config.rank, config.tensor_parallel_size, config.model)
        return ModelRunner(config, phases)
    # ranks that cannot meet; a tensor-parallel size that does not divide the model, a missing file
    except (GroupError, ValueError, OSError) as err:
        raise StartupError(str(err)) from None


def _set_health(servicer: health.HealthServicer, status) -> None:
    """The whole server and the Worker service by name (a client that finds it knows it reached a worker)."""
    for service in ("", worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name):
        servicer.set(service, status)
