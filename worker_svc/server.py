"""The Worker gRPC service: one process per tensor-parallel rank, around a ModelRunner."""
import logging
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.config import WorkerConfig
from worker_svc.distributed import exit_broken_rank, init_distributed

log = logging.getLogger("nanoserve.worker")


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner):
        self.runner = runner
        self.lock = threading.Lock()  # the runner is driven by one request at a time

    def Describe(self, request, context) -> worker_pb2.WorkerInfo:
        return self.runner.info()

    def AllocateKVCache(self, request, context) -> worker_pb2.AllocateKVCacheResponse:
        with self.lock:
            try:
                self.runner.allocate_kv_cache(request.num_blocks)
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except Exception as err:  # on CUDA, graph capture runs collectives too
                exit_broken_rank(f"allocating the KV cache failed: {err!r}")
        log.info("KV cache allocated: %d blocks", request.num_blocks)
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests: Iterator[worker_pb2.StepRequest], context) -> Iterator[worker_pb2.StepResponse]:
        log.info("step stream opened by %s", context.peer())
        replied = time.perf_counter()
        for request in requests:
            started = time.perf_counter()
            with self.lock:
                try:
                    reply = worker_pb2.StepResponse(step_id=request.step_id, token_ids=self.runner.step(request))
                except ValueError as err:  # a bad step: report it, keep serving
                    log.warning("step %d refused: %s", request.step_id, err)
                    reply = worker_pb2.StepResponse(step_id=request.step_id, error=str(err))
                except Exception as err:  # a collective whose peer is gone, a device fault: unrecoverable
                    exit_broken_rank(f"step {request.step_id} failed: {err!r}")
            replied, reply.idle_seconds = time.perf_counter(), started - replied
            reply.busy_seconds = replied - started
            yield reply
        log.info("step stream closed")


def serve_worker(config: WorkerConfig, host: str, port: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from worker_svc.runner import ModelRunner

    init_distributed(config)
    log.info("rank %d/%d loading %s", config.rank, config.tensor_parallel_size, config.model)
    try:
        runner = ModelRunner(config)
    except ValueError as err:  # e.g. a tensor-parallel size that does not divide the model
        log.error("rank %d cannot serve %s: %s", config.rank, config.model, err)
        return 1
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(runner), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        log.error("cannot listen on %s", address)
        return 1
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("rank %d serving on %s", config.rank, address)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    server.stop(grace=1).wait()
    return 0
