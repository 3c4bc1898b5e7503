"""A prefill step's host time against its GPU time on the worker, over prompt lengths: one new
sequence per step (the step behind a batch-1 time to first token), replayed from the piecewise
prefill graphs and, on the same runner, eagerly (the --enforce-eager path).

    python3 bench/prefill_profile.py [--lengths 16 128 512 2048 8192] [--attention-backend triton]

host: StepResponse.host_seconds, the time the worker took to turn the request into queued work.
gpu: the GPU time of that work alone: a sleep kernel is queued first, so the whole step is queued
before any of it runs, and the events around the step time nothing but its kernels. wall: one
step() with the device idle before and after (host and GPU in series, as a lone request sees it).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve.mathutil import cdiv  # noqa: E402
from nanoserve.v1 import worker_pb2  # noqa: E402
from nanoserve_cli.cache import bench_model_dir  # noqa: E402
from nanoserve_cli.demo_model import build_bench_model  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 256
SLEEP_CYCLES = 200_000_000  # ~0.1 s of device time: longer than any step's host part


class Prompts:
    """Fresh one-sequence prefill requests of a given length over the same blocks, each forgetting
    the one before it."""

    def __init__(self):
        self.seq_id = 0

    def next(self, length: int) -> worker_pb2.StepRequest:
        self.seq_id += 1
        return worker_pb2.StepRequest(step_id=self.seq_id, forget_seq_ids=[self.seq_id - 1], seqs=[worker_pb2.SeqStep(
            seq_id=self.seq_id, token_ids=[(self.seq_id * 31 + i) % 10_000 for i in range(length)], reset=True,
            sample=True, new_block_ids=range(cdiv(length, BLOCK_SIZE)))])


def measure(runner: ModelRunner, prompts: Prompts, length: int, repeat: int) -> dict[str, float]:
    host, gpu, wall = [], [], []
    runner.step(prompts.next(length))  # this length's first step
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.step(prompts.next(length))
        wall.append(time.perf_counter() - started)
        torch.cuda._sleep(SLEEP_CYCLES)
        request = prompts.next(length)
        reply = runner.launch(request).reply(request.step_id)
        host.append(reply.host_seconds)
        gpu.append(reply.busy_seconds)
    ms = {name: 1e3 * statistics.median(values) for name, values in (("host_ms", host), ("gpu_ms", gpu),
                                                                      ("wall_ms", wall))}
    return {**ms, "host_over_gpu": ms["host_ms"] / ms["gpu_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(bench_model_dir()))
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 2048, 8192])
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "prefill_profile.json"))
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        build_bench_model(Path(args.model))
    num_blocks = cdiv(max(args.lengths), BLOCK_SIZE) + 1
    runner = ModelRunner(WorkerConfig(model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                                      attention_backend=args.attention_backend, max_num_seqs=8,
                                      max_model_len=max(args.lengths) + BLOCK_SIZE))
    started = time.perf_counter()
    runner.allocate_kv_cache(num_blocks)
    result = {"backend": runner.backend.name, "capture_seconds": time.perf_counter() - started, "steps": {}}
    graphs, prompts = runner.graphs, Prompts()
    for mode in ("graphs", "eager"):
        runner.graphs = graphs if mode == "graphs" else None
        for length in args.lengths:
            result["steps"][f"{mode} {length}"] = measure(runner, prompts, length, args.repeat)
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'step':14s} {'host ms':>8s} {'gpu ms':>8s} {'host/gpu':>9s} {'wall ms':>8s}")
    for name, row in result["steps"].items():
        print(f"{name:14s} {row['host_ms']:8.2f} {row['gpu_ms']:8.2f} {row['host_over_gpu']:9.2f} {row['wall_ms']:8.2f}")


if __name__ == "__main__":
    main()
