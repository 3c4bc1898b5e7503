"""The scheduler service's own ceiling: the DESIGN §8 workload through a real scheduler process
and real gRPC clients, against a null worker that answers every step at once. Whatever time a
step takes here is host time (scheduling, protobuf, streaming tokens to the clients) that the
GPU must hide; above the GPU's own step time, the scheduler is the bottleneck.

With --step-ms the null worker stands in for a GPU that takes that long a step: steps queue on it
as they do on a real worker (the scheduler keeps several in flight), and `device_idle_ms_per_step`
is how long it waited for the scheduler between steps, the figure that costs throughput on the
H100 (the DESIGN workload's decode steps take ~6.5 ms there at 256 sequences).

    python bench/service_overhead.py [--num-seqs 256] [--step-ms 6.5] [--extra "--max-num-seqs 128"]
"""
import argparse
import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from nanoserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_serving  # noqa: E402
from throughput import drive, workload  # noqa: E402


class NullWorker(worker_pb2_grpc.WorkerServicer):
    """One rank that computes nothing: token 5 for every sampled entry, at once or after --step-ms."""

    def __init__(self, tokenizer_dir: str):
        self.info = worker_pb2.WorkerInfo(
            model=tokenizer_dir, rank=0, world_size=1, dtype="bfloat16", block_size=256, max_kv_blocks=2446,
            vocab_size=151936, max_model_len=4096, eos_token_ids=[151645], attention_backend="none",
            device="none", max_num_seqs=256, max_num_batched_tokens=16384, model_fingerprint="null",
            max_steps_in_flight=3)  # as deep as the GPU worker keeps steps in flight
        self.step_seconds = 0.0  # the emulated device's time a step (--step-ms)

    def Describe(self, request, context):
        return self.info

    def AllocateKVCache(self, request, context):
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests, context):
        if not self.step_seconds:
            for request in requests:
                yield self._reply(request, 0.0, 0.0)
            return
        arrivals: queue.SimpleQueue = queue.SimpleQueue()  # (request, when it arrived); None at the end
        threading.Thread(target=_read_into, args=(requests, arrivals), daemon=True).start()  # as the worker's inbox
        device_free = time.perf_counter()
        while (item := arrivals.get()) is not None:
            request, arrived = item
            idle = max(0.0, arrived - device_free)  # the device ran out of queued steps
            device_free = max(device_free, arrived) + self.step_seconds
            time.sleep(max(0.0, device_free - time.perf_counter()))
            yield self._reply(request, self.step_seconds, idle)

    def _reply(self, request: worker_pb2.StepRequest, busy: float, idle: float) -> worker_pb2.StepResponse:
        tokens = [5] * sum(1 for entry in request.seqs if entry.sample)
        return worker_pb2.StepResponse(step_id=request.step_id, token_ids=tokens, busy_seconds=busy,
                                       idle_seconds=idle)


def _read_into(requests, arrivals: queue.SimpleQueue) -> None:
    try:
        for request in requests:
            arrivals.put((request, time.perf_counter()))
    except grpc.RpcError:  # the scheduler closed the stream
        pass
    arrivals.put(None)


@contextlib.contextmanager
def null_service(tokenizer: str, extra: str = "", step_ms: float = 0.0) -> Iterator[str]:
    """A scheduler process over a NullWorker in this process (the tokenizer's directory lends the
    model's name and tokenizer), its steps taking `step_ms` each: the scheduler's address while it runs."""
    if not (Path(tokenizer) / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model"], check=True, cwd=REPO)  # fetches it
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    null_worker = NullWorker(tokenizer)
    null_worker.step_seconds = step_ms / 1e3
    worker_pb2_grpc.add_WorkerServicer_to_server(null_worker, worker)
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    scheduler = subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--port", str(port),
                                  "--workers", f"127.0.0.1:{worker_port}", *extra.split()], env=env)
    try:
        wait_serving(f"127.0.0.1:{port}", [scheduler], timeout=120)
        yield f"127.0.0.1:{port}"
    finally:
        stop_all([scheduler])
        worker.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokenizer", default=str(cache_dir() / "tokenizer-qwen3"))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=0.0, help="the emulated device's time a step (default: none)")
    p.add_argument("--extra", default="", help="more `nanoserve scheduler` flags, space separated")
    args = p.parse_args()
    with null_service(args.tokenizer, args.extra, args.step_ms) as address:
        result = asyncio.run(drive(address, workload(args.num_seqs, 1024, 1024)))
    steps = result["prefill_steps"] + result["decode_steps"]
    summary = {"output_tokens": result["output_tokens"], "seconds": result["seconds"],
               "tok_per_s": result["tok_per_s"], "steps": steps, "ms_per_step": 1e3 * result["seconds"] / steps,
               "step_ms": args.step_ms, "device_idle_ms_per_step": result["gpu_wait_between_decode_steps_ms"]}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
