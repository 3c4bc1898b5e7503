"""Latency through the public gRPC API: batch-1 time to first token over prompt lengths, and
inter-token latency at batch 1, 8 and 64 (the latency workload of docs/benchmarks.md).

    python3 bench/latency.py                      # starts `nanoserve up` on the demo model (CPU works)
    python3 bench/latency.py --model DIR          # ... on a checkpoint (e.g. on the GPU machine)
    python3 bench/latency.py --address HOST:PORT  # against a server that is already running
    python3 bench/latency.py --model DIR --extra "--load-format dummy"  # a shape without its weights
                                                  # (DIR: config.json + tokenizer, see bench/throughput.py)

Every prompt is fresh random token ids, so the prefix cache never serves one. The worker's own view
of the steps (host time spent building and launching them vs device time, from GetStats) is
reported beside each part: the gap between them is what the GPU waits for Python.
"""
import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve.client import make_request  # noqa: E402
from nanoserve.healthcheck import SERVING, serving_status  # noqa: E402
from nanoserve.v1 import llm_pb2, llm_pb2_grpc  # noqa: E402

STEP_FIELDS = ("prefill_steps", "decode_steps", "prefill_tokens", "decode_tokens", "prefill_busy_seconds",
               "decode_busy_seconds", "prefill_host_seconds", "decode_host_seconds", "decode_idle_seconds")


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered), "n": len(ordered)}


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(0, 10000) for _ in range(length)]


class StepWindow:
    """GetStats before and after a part: the worker's steps taken in between, per step."""

    def __init__(self, stub):
        self.stub = stub

    async def __aenter__(self) -> "StepWindow":
        self.before = await self.stub.GetStats(llm_pb2.GetStatsRequest())
        return self

    async def __aexit__(self, *exc) -> None:
        self.after = await self.stub.GetStats(llm_pb2.GetStatsRequest())

    def breakdown(self) -> dict[str, float]:
        d = {name: getattr(self.after, name) - getattr(self.before, name) for name in STEP_FIELDS}
        out = {"prefill_steps": d["prefill_steps"], "decode_steps": d["decode_steps"]}
        for kind in ("prefill", "decode"):
            steps = max(d[f"{kind}_steps"], 1)
            out[f"{kind}_host_ms_per_step"] = 1e3 * d[f"{kind}_host_seconds"] / steps
            out[f"{kind}_gpu_ms_per_step"] = 1e3 * d[f"{kind}_busy_seconds"] / steps
            out[f"{kind}_tokens_per_step"] = d[f"{kind}_tokens"] / steps
        out["decode_device_idle_ms_per_step"] = 1e3 * d["decode_idle_seconds"] / max(d["decode_steps"], 1)
        return out


async def time_to_first_token(stub, prompt: list[int]) -> float:
    start = time.perf_counter()
    call = stub.Generate(make_request(prompt, max_tokens=1, temperature=0.0, ignore_eos=True))
    async for msg in call:
        if msg.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


async def stream_gaps(stub, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds between tokens after the first; a message carrying k tokens counts as k equal gaps."""
    gaps, last = [], None
    async for msg in stub.Generate(make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)):
        now = time.perf_counter()
        if last is not None and msg.token_ids:
            gaps += [(now - last) / len(msg.token_ids)] * len(msg.token_ids)
        last = now
    return gaps


async def measure(address: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        info = await stub.GetModelInfo(llm_pb2.GetModelInfoRequest())
        for _ in range(3):  # warm-up: first steps of each kind, allocator, connections
            await stream_gaps(stub, random_prompt(rng, 64), 8)
        result = {"model": info.model, "attention_backend": info.attention_backend, "ttft": {}, "itl": {}}
        for length in args.prompt_lens:
            if length >= info.max_model_len:
                result["ttft"][str(length)] = {"skipped": f"max_model_len is {info.max_model_len}"}
                continue
            await time_to_first_token(stub, random_prompt(rng, length))  # this length's first step
            async with StepWindow(stub) as window:
                times = [await time_to_first_token(stub, random_prompt(rng, length)) for _ in range(args.repeats)]
            result["ttft"][str(length)] = {**{k: v * 1e3 if k != "n" else v for k, v in percentiles(times).items()},
                                           "worker": window.breakdown()}
        for batch in args.batches:
            prompts = [random_prompt(rng, args.itl_prompt_len) for _ in range(batch)]
            async with StepWindow(stub) as window:
                started = time.perf_counter()
                gaps = await asyncio.gather(*(stream_gaps(stub, p, args.itl_tokens) for p in prompts))
                seconds = time.perf_counter() - started
            flat = [g for per_stream in gaps for g in per_stream]
            result["itl"][str(batch)] = {**{k: v * 1e3 if k != "n" else v for k, v in percentiles(flat).items()},
                                         "tok_per_s_per_stream": 1 / statistics.fmean(flat),
                                         "tok_per_s": batch * args.itl_tokens / seconds,
                                         "worker": window.breakdown()}
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                    os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "nanoserve_cli", "up", "--port", str(port), "--worker-base-port", str(free_port()),
           "--max-model-len", str(args.max_model_len), *(["--model", args.model] if args.model else []),
           *args.extra.split()]
    proc = subprocess.Popen(cmd, env=env)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"nanoserve up exited with code {proc.returncode}")
        try:
            if serving_status(address, timeout=1) == SERVING:
                return proc, address
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start within 900 s")


def print_table(result: dict) -> None:
    print(f"{'part':18s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s}  worker host / GPU ms per step")
    for part in ("ttft", "itl"):
        for key, row in result[part].items():
            if "skipped" in row:
                print(f"{part} {key:13s} skipped: {row['skipped']}")
                continue
            w = row["worker"]
            kind = "prefill" if part == "ttft" else "decode"
            print(f"{part} {key:13s} {row['p50']:9.2f} {row['p90']:9.2f} {row['p99']:9.2f}  "
                  f"{kind}: {w[f'{kind}_host_ms_per_step']:.2f} / {w[f'{kind}_gpu_ms_per_step']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="", help="a running server; default: start `nanoserve up`")
    p.add_argument("--model", default="", help="checkpoint for the started server; default: the demo model")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    p.add_argument("--extra", default="", help="more `nanoserve up` flags, space separated")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512, 2048, 8000])
    p.add_argument("--repeats", type=int, default=20, help="TTFT samples per prompt length")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--itl-prompt-len", type=int, default=512)
    p.add_argument("--itl-tokens", type=int, default=256)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "latency.json"))
    args = p.parse_args()

    proc, address = (None, args.address) if args.address else start_server(args)
    try:
        result = asyncio.run(measure(address, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
