"""A prefill step's host time against its GPU time on the worker, over prompt lengths: one new
sequence per step (the step behind a batch-1 time to first token), replayed from the piecewise
prefill graphs and, on the same runner, eagerly (the --enforce-eager path). With --decodes N, every
step is a mixed one: N running sequences (--decode-context tokens each) decode beside the prompt,
as under load with chunked prefill; --prompts P starts P prompts of the length in every step (a
throughput workload's prefill); --profile prints where the largest step's time goes.

    python3 bench/prefill_profile.py [--lengths 16 128 512 2048 8192] [--attention-backend triton]
        [--decodes 128 --decode-context 512] [--prompts 8] [--profile] [--model DIR --load-format dummy]

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
from nanoserve.step_rows import StepEntry, pack_step  # noqa: E402
from nanoserve.v1 import worker_pb2  # noqa: E402
from nanoserve_cli.cache import bench_model_dir  # noqa: E402
from nanoserve_cli.demo_model import build_bench_model  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 256
SLEEP_CYCLES = 200_000_000  # ~0.1 s of device time: longer than any step's host part
DECODE_IDS = 1_000_000  # the running sequences' ids, apart from the prompts'


class Prompts:
    """Fresh prefill requests of a given length, `prompts` new sequences a step over the same blocks,
    each step forgetting the sequences of the one before it; with decodes, each step first decodes one
    token of every running sequence (ids from DECODE_IDS on, their blocks after the prompts')."""

    def __init__(self, prompt_blocks: int, decodes: int = 0, decode_context: int = 0, prompts: int = 1):
        self.step_id = 0
        self.prompt_blocks, self.decodes, self.decode_context = prompt_blocks, decodes, decode_context
        self.prompts = prompts
        self.decoded = 0

    def blocks_needed(self, steps: int) -> int:
        return self.prompts * self.prompt_blocks + self.decodes * cdiv(self.decode_context + steps, BLOCK_SIZE)

    def start_decodes(self, runner: ModelRunner, steps: int) -> None:
        """Prefills the running sequences, with room for `steps` more tokens each."""
        per_seq = cdiv(self.decode_context + steps, BLOCK_SIZE)
        for i in range(self.decodes):
            first = self.prompts * self.prompt_blocks + i * per_seq
            runner.step(pack_step(0, [StepEntry(
                DECODE_IDS + i, [(i * 7 + t) % 10_000 for t in range(self.decode_context)], sample=True, reset=True,
                new_block_ids=range(first, first + per_seq))]))

    def next(self, length: int) -> worker_pb2.StepRequest:
        self.step_id += 1
        computed = self.decode_context + self.decoded
        self.decoded += 1
        decodes = [StepEntry(DECODE_IDS + i, num_computed=computed, sample=True, num_generated=self.decoded)
                   for i in range(self.decodes)]
        first_id, blocks = self.step_id * self.prompts, cdiv(length, BLOCK_SIZE)
        prompts = [StepEntry(
            first_id + j, [((first_id + j) * 31 + i) % 10_000 for i in range(length)], sample=True, reset=True,
            new_block_ids=range(j * self.prompt_blocks, j * self.prompt_blocks + blocks))
            for j in range(self.prompts)]
        return pack_step(self.step_id, [*decodes, *prompts], forget_seq_ids=range(first_id - self.prompts, first_id))


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


def profile(runner: ModelRunner, request: worker_pb2.StepRequest) -> None:
    """The step's CUDA kernels and host-side ops, largest first."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        runner.step(request)
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(bench_model_dir()))
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 2048, 8192])
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--load-format", default="auto", help="dummy: random weights for a config-only directory")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--decodes", type=int, default=0, help="running sequences decoding beside each prompt")
    p.add_argument("--decode-context", type=int, default=512, help="their context length at the start")
    p.add_argument("--prompts", type=int, default=1, help="prompts of the length started in every step")
    p.add_argument("--profile", action="store_true", help="print the kernels and host ops of the largest step")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "prefill_profile.json"))
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        build_bench_model(Path(args.model))
    steps = 2 * len(args.lengths) * (2 * args.repeat + 1) + 2
    prompts = Prompts(cdiv(max(args.lengths), BLOCK_SIZE), args.decodes, args.decode_context, args.prompts)
    num_blocks = prompts.blocks_needed(steps) + 1
    runner = ModelRunner(WorkerConfig(
        model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, attention_backend=args.attention_backend,
        max_num_seqs=max(8, args.decodes + args.prompts),
        max_num_batched_tokens=max(8192, args.prompts * max(args.lengths) + args.decodes),
        max_model_len=max(max(args.lengths), args.decode_context + steps) + BLOCK_SIZE, load_format=args.load_format))
    started = time.perf_counter()
    runner.allocate_kv_cache(num_blocks)
    result = {"backend": runner.backend.name, "capture_seconds": time.perf_counter() - started, "steps": {},
              "decodes": args.decodes, "decode_context": args.decode_context, "prompts": args.prompts}
    prompts.start_decodes(runner, steps)
    graphs = runner.graphs
    for mode in ("graphs", "eager"):
        runner.graphs = graphs if mode == "graphs" else None
        for length in args.lengths:
            result["steps"][f"{mode} {length}"] = measure(runner, prompts, length, args.repeat)
        if args.profile:
            profile(runner, prompts.next(max(args.lengths)))
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'step':14s} {'host ms':>8s} {'gpu ms':>8s} {'host/gpu':>9s} {'wall ms':>8s}")
    for name, row in result["steps"].items():
        print(f"{name:14s} {row['host_ms']:8.2f} {row['gpu_ms']:8.2f} {row['host_over_gpu']:9.2f} {row['wall_ms']:8.2f}")


if __name__ == "__main__":
    main()
