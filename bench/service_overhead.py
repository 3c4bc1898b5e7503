"""The scheduler service's own ceiling: the DESIGN §8 workload through a real scheduler process
and real gRPC clients, against a null worker that answers every step at once. Whatever time a
step takes here is host time (scheduling, protobuf, streaming tokens to the clients) that the
GPU must hide; above the GPU's own step time, the scheduler is the bottleneck.

    python bench/service_overhead.py [--num-seqs 256] [--extra "--stream-interval 2"]
"""
import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
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
    """One rank that computes nothing: token 5 for every sampled entry, at once."""

    def __init__(self, tokenizer_dir: str):
        self.info = worker_pb2.WorkerInfo(
            model=tokenizer_dir, rank=0, world_size=1, dtype="bfloat16", block_size=256, max_kv_blocks=2446,
            vocab_size=151936, max_model_len=4096, eos_token_ids=[151645], attention_backend="none",
            device="none", max_num_seqs=256, max_num_batched_tokens=16384, model_fingerprint="null",
            max_steps_in_flight=3)  # as deep as the GPU worker keeps steps in flight

    def Describe(self, request, context):
        return self.info

    def AllocateKVCache(self, request, context):
        return worker_pb2.AllocateKVCacheResponse(num_blocks=request.num_blocks)

    def Step(self, requests, context):
        for request in requests:
            started = time.perf_counter()
            tokens = [5] * sum(1 for entry in request.seqs if entry.sample)
            seconds = time.perf_counter() - started
            yield worker_pb2.StepResponse(step_id=request.step_id, token_ids=tokens, busy_seconds=seconds,
                                          host_seconds=seconds)


@contextlib.contextmanager
def null_service(tokenizer: str, extra: str = "") -> Iterator[str]:
    """A scheduler process over a NullWorker in this process (the tokenizer's directory lends the
    model's name and tokenizer): the scheduler's address while it runs."""
    if not (Path(tokenizer) / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model"], check=True, cwd=REPO)  # fetches it
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(NullWorker(tokenizer), worker)
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
    p.add_argument("--extra", default="", help="more `nanoserve scheduler` flags, space separated")
    args = p.parse_args()
    with null_service(args.tokenizer, args.extra) as address:
        result = asyncio.run(drive(address, workload(args.num_seqs, 1024, 1024)))
    steps = result["prefill_steps"] + result["decode_steps"]
    summary = {"output_tokens": result["output_tokens"], "seconds": result["seconds"],
               "tok_per_s": result["tok_per_s"], "steps": steps, "ms_per_step": 1e3 * result["seconds"] / steps}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
