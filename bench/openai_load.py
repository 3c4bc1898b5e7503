"""The DESIGN §8 throughput workload through the OpenAI gateway (streamed), beside the same
workload over gRPC, plus batch-1 time to first token on both paths: what the gateway costs.

    python bench/openai_load.py --scheduler 127.0.0.1:50051            # starts a gateway in front
    python bench/openai_load.py --scheduler HOST:PORT --openai http://HOST:8000   # a running gateway
    python bench/openai_load.py --null-worker   # CPU only: scheduler + a worker that computes nothing

With --null-worker every step returns at once, so the tokens per second are the services' own
ceiling (scheduler, gateway, clients), not a model's.

On the GPU machine, whose image (DESIGN §9) has no HTTP stack, carry these wheels in .whl/
(bench/gpu_checks.sh installs .whl/*.whl with --no-deps), fetched on a CPU machine with

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
      fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 pydantic==2.14.3 pydantic-core==2.50.4 \
      annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 \
      uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 idna==3.20 Jinja2==3.1.6 MarkupSafe==3.0.4 \
      httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.18 prometheus-client==0.26.0 \
      grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0

(22 wheels, 4 MB: this bench, the scheduler and the gateway ran with --null-worker on these plus grpcio,
protobuf, tokenizers, xxhash and nothing else; some of them come with transformers there already.)
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from nanoserve.client import make_request  # noqa: E402
from nanoserve.v1 import llm_pb2_grpc, worker_pb2_grpc  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_http_ok, wait_serving  # noqa: E402
from service_overhead import NullWorker  # noqa: E402
from throughput import drive, workload  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                os.environ.get("PYTHONPATH")]))}


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, **sampling) -> tuple[int, float]:
    """One streamed completion: (completion tokens from the usage event, seconds to the first event).
    `sampling`: more request fields, under the names both APIs give them (top_p, top_k, logprobs)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    started = time.perf_counter()
    ttft, tail = None, b""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in response.aiter_bytes():
            ttft = ttft or time.perf_counter() - started
            tail = (tail + data)[-4096:]  # only the last events are parsed: usage, then [DONE]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    assert usage["completion_tokens"] == max_tokens, (usage, max_tokens)
    return max_tokens, ttft


async def drive_openai(url: str, jobs: list[tuple[list[int], int]], **sampling) -> dict:
    limits = httpx.Limits(max_connections=len(jobs) + 8, max_keepalive_connections=len(jobs) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await stream_one(client, [1, 2, 3, 4], 16, **sampling)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, p, n, **sampling) for p, n in jobs))
        seconds = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    return {"output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * statistics.median(t for _, t in results)}


async def batch1_ttft(scheduler: str, url: str, count: int, prompt_len: int = 512) -> dict:
    """Median seconds to the first token of one request at a time, over gRPC and through the gateway."""
    prompts = [[(i * 7919 + j * 31) % 10000 for j in range(prompt_len)] for i in range(count)]  # no prefix hits
    grpc_times, http_times = [], []
    async with grpc.aio.insecure_channel(scheduler) as channel, httpx.AsyncClient(base_url=url, timeout=None) as hc:
        stub = llm_pb2_grpc.LLMStub(channel)
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            async for _ in stub.Generate(make_request(prompt, max_tokens=1, ignore_eos=True)):
                grpc_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            _, ttft = await stream_one(hc, [(t + 1) % 10000 for t in prompt], 1)
            http_times.append(ttft)
    return {"batch1_ttft_p50_ms_grpc": 1e3 * statistics.median(grpc_times),
            "batch1_ttft_p50_ms_openai": 1e3 * statistics.median(http_times)}


def start_null_service() -> tuple[str, grpc.Server, subprocess.Popen]:
    """A scheduler on a NullWorker; the Qwen3 tokenizer files (fetched with the demo model) lend their tokenizer."""
    tokenizer = cache_dir() / "tokenizer-qwen3"
    if not (tokenizer / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model"], check=True, cwd=REPO, env=ENV)
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(NullWorker(str(tokenizer)), worker)
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    address = f"127.0.0.1:{free_port()}"
    scheduler = subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--host", "127.0.0.1",
                                  "--port", address.split(":")[1], "--workers", f"127.0.0.1:{worker_port}"], env=ENV)
    wait_serving(address, [scheduler], timeout=120)
    return address, worker, scheduler


def start_gateway(scheduler: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway_svc", "--scheduler", scheduler, "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", [proc], timeout=60)
    except RuntimeError:
        stop_all([proc])
        raise
    return url, proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", default="", help="host:port of a serving scheduler")
    p.add_argument("--openai", default="", help="base URL of a running gateway; default: start one")
    p.add_argument("--null-worker", action="store_true", help="start a scheduler on a worker that computes nothing")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--ttft-requests", type=int, default=50, help="batch-1 requests per path; 0 = skip")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: unset)")
    p.add_argument("--top-k", type=int, default=None, help="every request's top_k (default: unset)")
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request's logprobs: N alternatives per token, streamed in each event (default: none)")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "openai_load.json"))
    args = p.parse_args()
    if not (args.scheduler or args.null_worker):
        p.error("give --scheduler HOST:PORT or --null-worker")

    owned, worker = [], None
    try:
        scheduler = args.scheduler
        if args.null_worker:
            scheduler, worker, proc = start_null_service()
            owned.append(proc)
        url = args.openai
        if not url:
            url, proc = start_gateway(scheduler)
            owned.append(proc)
        jobs = workload(args.num_seqs, args.max_input_len, args.max_output_len)
        sampling = {name: value for name, value in
                    (("top_p", args.top_p), ("top_k", args.top_k), ("logprobs", args.logprobs)) if value is not None}
        over_grpc = asyncio.run(drive(scheduler, jobs, **sampling))
        over_openai = asyncio.run(drive_openai(url, jobs, **sampling))
        result = {"grpc_tok_per_s": over_grpc["tok_per_s"], "openai_tok_per_s": over_openai["tok_per_s"],
                  "openai_vs_grpc": over_openai["tok_per_s"] / over_grpc["tok_per_s"],
                  "openai_ttft_p50_ms_under_load": over_openai["ttft_p50_ms"],
                  "output_tokens": over_openai["output_tokens"], "requests": len(jobs)}
        if args.ttft_requests:
            result.update(asyncio.run(batch1_ttft(scheduler, url, args.ttft_requests)))
            result["gateway_adds_to_batch1_ttft_ms"] = (result["batch1_ttft_p50_ms_openai"]
                                                        - result["batch1_ttft_p50_ms_grpc"])
    finally:
        stop_all(owned)
        if worker is not None:
            worker.stop(0)
    result["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'metric':36s} value")
    for key, value in result.items():
        print(f"{key:36s} {value:.2f}" if isinstance(value, float) else f"{key:36s} {value}")


if __name__ == "__main__":
    main()
