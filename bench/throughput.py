"""End-to-end throughput through the real services (the workloads of docs/benchmarks.md).

Starts `nanoserve up` on a Qwen3-0.6B-shaped checkpoint with random bf16 weights (built on first
use), drives it with every request's gRPC Generate stream at once, prints a table and writes JSON.

--workload design (the default): 256 requests, prompts and outputs uniform in [100, 1,024].
--workload heavy (issue 15): 1,024 requests, prompts and outputs uniform in [100, 2,048], the server at
--max-model-len 4096, so the KV pool runs out and sequences are preempted. --num-seqs,
--max-input-len and --max-output-len override a workload's numbers.

Issue 18's sampling cost: the same run with `--top-p 0.9 --top-k 50` on every request.

Any shape without its weights: write a directory holding only config.json and the tokenizer, and let
the worker make random weights on the GPU:

    python -m nanoserve_cli.demo_model /tmp/qwen3-8b --shape qwen3-8b --no-weights
    python3 bench/throughput.py --model /tmp/qwen3-8b --extra "--load-format dummy"
"""
import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve.client import make_request  # noqa: E402
from nanoserve.v1 import llm_pb2, llm_pb2_grpc  # noqa: E402
from nanoserve_cli.cache import bench_model_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_serving  # noqa: E402


# name -> requests, longest prompt, longest output (each uniform from 100)
WORKLOADS = {"design": (256, 1024, 1024), "heavy": (1024, 2048, 2048)}


def workload(num_seqs: int, max_input: int, max_output: int) -> list[tuple[list[int], int]]:
    """The seeds' benchmark: seed 0, prompts of random ids in [0, 10000], random lengths."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))] for _ in range(num_seqs)]
    return [(p, random.randint(100, max_output)) for p in prompts]


async def run_one(stub, prompt: list[int], max_tokens: int, **sampling) -> int:
    request = make_request(prompt, max_tokens=max_tokens, temperature=0.6, ignore_eos=True, **sampling)
    count = 0
    async for msg in stub.Generate(request):
        count += len(msg.token_ids)
    assert count == max_tokens, (count, max_tokens)
    return count


async def drive(address: str, jobs: list[tuple[list[int], int]], **sampling) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        await run_one(stub, [1, 2, 3, 4], 16, **sampling)  # warm-up
        before = await stub.GetStats(llm_pb2.GetStatsRequest())
        start = time.perf_counter()
        counts = await asyncio.gather(*(run_one(stub, p, n, **sampling) for p, n in jobs))
        seconds = time.perf_counter() - start
        after = await stub.GetStats(llm_pb2.GetStatsRequest())
        info = await stub.GetModelInfo(llm_pb2.GetModelInfoRequest())

    def delta(name: str) -> float:
        return getattr(after, name) - getattr(before, name)

    return {
        "output_tokens": sum(counts), "seconds": seconds, "tok_per_s": sum(counts) / seconds,
        "requests": len(jobs), "prompt_tokens": sum(len(p) for p, _ in jobs),
        "prefill_steps": delta("prefill_steps"), "decode_steps": delta("decode_steps"),
        "mixed_steps": delta("mixed_steps"), "decodes_in_mixed_steps": delta("mixed_decode_tokens"),
        # prompt tokens over the time of the steps that computed them (mixed steps' decodes ride in that time)
        "prefill_tok_per_s": delta("prefill_tokens") / max(delta("prefill_busy_seconds"), 1e-9),
        "decode_tok_per_s": delta("decode_tokens") / max(delta("decode_busy_seconds"), 1e-9),
        "decode_step_ms": 1e3 * delta("decode_busy_seconds") / max(delta("decode_steps"), 1),
        "gpu_wait_between_decode_steps_ms": 1e3 * delta("decode_idle_seconds") / max(delta("decode_steps"), 1),
        "kv_blocks": info.num_kv_blocks, "attention_backend": info.attention_backend,
        "tensor_parallel_size": info.tensor_parallel_size,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(bench_model_dir()))
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--workload", choices=WORKLOADS, default="design")
    p.add_argument("--num-seqs", type=int, help="requests (default: the workload's)")
    p.add_argument("--max-input-len", type=int, help="longest prompt (default: the workload's)")
    p.add_argument("--max-output-len", type=int, help="longest output (default: the workload's)")
    p.add_argument("--max-model-len", type=int, default=4096, help="as the nano-vllm anchor's bench.py")
    p.add_argument("--extra", default="", help="more `nanoserve up` flags, space separated")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: unset)")
    p.add_argument("--top-k", type=int, default=None, help="every request's top_k (default: unset)")
    p.add_argument("--out", help="default: bench/out/throughput.json (throughput-heavy.json for the heavy workload)")
    args = p.parse_args()
    for name, value in zip(("num_seqs", "max_input_len", "max_output_len"), WORKLOADS[args.workload]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out = args.out or str(REPO / "bench" / "out" / ("throughput.json" if args.workload == "design"
                                                         else f"throughput-{args.workload}.json"))

    model = Path(args.model)
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model", str(model), "--shape", "qwen3-0.6b"],
                       check=True, cwd=REPO)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                    os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "nanoserve_cli", "up", "--model", str(model), "--port", str(port),
           "--worker-base-port", str(free_port()), "--tensor-parallel-size", str(args.tensor_parallel_size),
           "--attention-backend", args.attention_backend, "--max-model-len", str(args.max_model_len),
           *args.extra.split()]
    proc = subprocess.Popen(cmd, env=env)
    try:
        wait_serving(f"127.0.0.1:{port}", [proc], timeout=900)
        result = asyncio.run(drive(f"127.0.0.1:{port}", workload(args.num_seqs, args.max_input_len,
                                                                 args.max_output_len),
                                   top_p=args.top_p, top_k=args.top_k))
    finally:
        stop_all([proc])
    result["workload"] = {"name": args.workload, "requests": args.num_seqs, "max_input_len": args.max_input_len,
                          "max_output_len": args.max_output_len, "max_model_len": args.max_model_len}
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'metric':36s} value")
    for key, value in result.items():
        print(f"{key:36s} {value:.1f}" if isinstance(value, float) else f"{key:36s} {value}")


if __name__ == "__main__":
    main()
