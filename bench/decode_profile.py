"""Where a decode step's time goes on the worker: host preparation, the replayed forward pass,
logits + sampling, and the whole step, for the benchmark model at batch B x context C; then
the step time when each step is launched before the previous one is read back, as the
pipelined worker runs them, and the host time a launch takes (StepResponse.host_seconds).

    python3 bench/decode_profile.py [--batch 256] [--context 1024] [--attention-backend triton]
        [--model DIR --load-format dummy] [--host-profile]
"""
import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve.mathutil import cdiv  # noqa: E402
from nanoserve.step_rows import StepEntry, pack_step  # noqa: E402
from nanoserve.v1 import llm_pb2, worker_pb2  # noqa: E402
from nanoserve_cli.cache import bench_model_dir  # noqa: E402
from nanoserve_cli.demo_model import build_bench_model  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.step_inputs import build_step_inputs  # noqa: E402


def timed(fn, repeat: int = 20) -> float:
    """Median wall milliseconds of fn() with the GPU drained after each call."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def pipelined(runner: ModelRunner, step: worker_pb2.StepRequest, count: int = 20) -> tuple[float, float]:
    """Wall milliseconds per step over `count` steps, each launched before the previous reply,
    and the median host milliseconds of a launch."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    launched, host = runner.launch(step), []
    for _ in range(count - 1):
        following = runner.launch(step)
        host.append(launched.reply(step.step_id).host_seconds)
        launched = following
    host.append(launched.reply(step.step_id).host_seconds)
    return 1e3 * (time.perf_counter() - start) / count, 1e3 * sorted(host)[len(host) // 2]


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(bench_model_dir()))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    p.add_argument("--load-format", default="auto", help="dummy: random weights for a config-only directory")
    p.add_argument("--host-profile", action="store_true",
                   help="also print the host functions that take the most time in pipelined launches (cProfile)")
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        build_bench_model(Path(args.model))
    bs, blocks = 256, cdiv(args.context + 64, 256)
    runner = ModelRunner(WorkerConfig(model=args.model, block_size=bs, num_kv_blocks=args.batch * blocks + 8,
                                      attention_backend=args.attention_backend, max_num_seqs=args.batch,
                                      max_model_len=args.max_model_len, load_format=args.load_format))
    runner.allocate_kv_cache(args.batch * blocks + 8)
    sampling = llm_pb2.SamplingParams(temperature=args.temperature)
    per_step = max(1, runner.config.max_num_batched_tokens // args.context)
    for first in range(0, args.batch, per_step):  # prefill every sequence to the context length
        runner.step(pack_step(0, [
            StepEntry(i, [i % 1000 + 1] * args.context, sample=True, reset=True, sampling=sampling,
                      new_block_ids=range(i * blocks, (i + 1) * blocks))
            for i in range(first, min(args.batch, first + per_step))]))
    step = pack_step(0, [StepEntry(i, [7], args.context, sample=True, num_generated=1) for i in range(args.batch)])
    work = runner.seqs.apply(step)
    graphs = runner.graphs.decode
    num_rows = graphs.batch_size(args.batch)

    def build():
        return build_step_inputs(work, runner.seqs, runner.backend, runner.last_tokens, runner.buffers,
                                 runner.sampler, num_rows)

    inputs = build()
    hidden = graphs.replay(args.batch)
    result = {
        "host_apply_ms": timed(lambda: runner.seqs.apply(step)),
        "host_inputs_ms": timed(build),
        "graph_forward_ms": timed(lambda: graphs.replay(args.batch)),
        "logits_and_sample_ms": timed(lambda: runner.sampler(runner.model.compute_logits(hidden),
                                                             inputs.sampling)),
        "whole_step_ms": timed(lambda: runner.step(step)),
    }
    result["pipelined_step_ms"], result["host_launch_ms"] = pipelined(runner, step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.step(step)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    if args.host_profile:
        host = cProfile.Profile()
        host.runcall(pipelined, runner, step, 200)
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
    result.update(batch=args.batch, context=args.context, backend=runner.backend.name)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
