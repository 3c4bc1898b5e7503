"""Replicas behind SMG (issue 36): cache-aware against round-robin routing on a multi-tenant prefix
workload, and what the router adds to the time to first token at low load.

Workload: tenants, each with a long system prompt of its own, several users each asking a short
question of it; sized so that the system prompts fill --kv-fill (default 0.7) of the replicas'
combined KV pool (read from GetStats), so that split by tenant they fit and spread over every
replica they do not. Requests arrive as a Poisson process (bench/serve.py's), in a shuffled order.
Each policy gets a router of its own and tenants of its own (another seed): what the other policy
left cached is never hit. Reported per policy: output tok/s, TTFT and TPOT percentiles, errors, and
the prefix-cache hit rate the replicas counted (hit tokens over prompt tokens, GetStats). Then
--overhead-requests requests one at a time, straight to the first replica and through the router:
their TTFT percentiles and the difference.

Prompts are text (SMG's HTTP completions take no token-id prompts): words drawn from a small
vocabulary, about one token each with the Qwen3 tokenizer. The replicas are started by the caller
(bench/gpu_routers.sh starts one `nanoserve up` per GPU):

    python3 bench/router_prefix.py --replicas http://127.0.0.1:8001=127.0.0.1:50051 \\
        http://127.0.0.1:8002=127.0.0.1:50052 --out bench/out/router_prefix.json
"""
import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from serve import RequestFailed, replica_stats, run_rate, summarize  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all  # noqa: E402
from nanoserve.flags import defaults  # noqa: E402
from nanoserve_cli.router import router_command, wait_routing  # noqa: E402

WORDS = ("river stone lantern orbit meadow copper violet harbor signal quartz ember falcon glacier thimble cobalt "
         "saffron tundra walnut zephyr marble garden window silver forest bridge candle desert island mirror "
         "planet rocket shadow thunder valley winter").split()


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    max_tokens: int


class RouterTarget:
    """Streamed /v1/completions with text prompts and the model named (SMG needs it); tokens are counted
    from each event's token_ids (vLLM's return_token_ids)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.session: aiohttp.ClientSession | None = None

    async def stream(self, request: TextRequest) -> AsyncIterator[int]:
        if self.session is None:
            self.session = aiohttp.ClientSession(self.url, connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None))
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        async with self.session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if line.startswith(b"data: {"):
                    yield sum(len(choice.get("token_ids", ())) for choice in json.loads(line[6:])["choices"])

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def tenant_requests(tenants: int, users: int, system_len: int, question_len: tuple[int, int], output_len: int,
                    seed: int) -> list[TextRequest]:
    rng = random.Random(seed)
    systems = [f"Tenant {t} system prompt: {words(rng, system_len)}" for t in range(tenants)]
    requests = [TextRequest(f"{system}\nUser {u}: {words(rng, rng.randint(*question_len))}", output_len)
                for system in systems for u in range(users)]
    rng.shuffle(requests)
    return requests


def start_smg(urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    """SMG as `nanoserve up --data-parallel-size N` runs it (nanoserve_cli/router.py), with `policy`."""
    port = free_port()
    up = argparse.Namespace(host="127.0.0.1", openai_port=port, router_policy=policy, shutdown_timeout=5,
                              max_num_seqs=defaults("up")["max_num_seqs"])
    proc = subprocess.Popen(router_command(up, urls, free_port()), stdout=log.open("ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_routing(url, len(urls), lambda: proc.poll() is None, 120)
    return proc, url


async def run_policy(args: argparse.Namespace, policy: str, seed: int, tenants: int, model: str) -> dict:
    proc, url = start_smg(args.urls, policy, args.log)
    target = RouterTarget(url, model)
    try:
        warmup = tenant_requests(4, 1, 16, (4, 8), 4, seed + 1000)
        await run_rate(target, warmup, math.inf)
        requests = tenant_requests(tenants, args.users_per_tenant, args.system_prompt_len, tuple(args.question_len),
                                   args.output_len, seed)
        before = await replica_stats(args.addresses)
        results, seconds = await run_rate(target, requests, args.request_rate, seed)
        after = await replica_stats(args.addresses)
    finally:
        await target.close()
        stop_all([proc])
    summary = summarize(results, seconds, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    hits = sum(a.prefix_cache_hit_tokens - b.prefix_cache_hit_tokens for a, b in zip(after, before))
    prompts = sum(a.prompt_tokens_total - b.prompt_tokens_total for a, b in zip(after, before))
    summary["prefix_hit_rate"] = hits / prompts if prompts else 0.0
    summary["requests_per_replica"] = [a.requests_finished - b.requests_finished for a, b in zip(after, before)]
    return summary


async def router_overhead(args: argparse.Namespace, model: str) -> dict:
    """Batch-1 TTFT of the same short requests straight to the first replica and through cache-aware SMG."""
    proc, url = start_smg(args.urls, "cache_aware", args.log)
    ttft = {}
    try:
        for label, base in (("direct", args.urls[0]), ("smg", url), ("direct_again", args.urls[0])):
            target = RouterTarget(base, model)
            requests = tenant_requests(args.overhead_requests, 1, 100, (8, 8), 1, 7)
            results, _ = await run_rate(target, requests, math.inf, max_concurrency=1)
            await target.close()
            ttft[label] = summarize(results, 1.0, 1.0, 1.0)["ttft_ms"]
    finally:
        stop_all([proc])
    ttft["added_p50_ms"] = ttft["smg"]["p50"] - ttft["direct"]["p50"]
    return ttft


async def benchmark(args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession(args.urls[0]) as session:
        async with session.get("/server_info") as response:
            info = await response.json()
    model, block_size = info["served_model_name"], info["page_size"]
    stats = await replica_stats(args.addresses)
    kv_tokens = sum(s.kv_blocks_total for s in stats) * block_size
    tenants = args.tenants or max(2, round(args.kv_fill * kv_tokens / args.system_prompt_len))
    report = {"model": model, "replicas": len(args.urls), "kv_tokens": kv_tokens, "tenants": tenants,
              "users_per_tenant": args.users_per_tenant, "system_prompt_words": args.system_prompt_len,
              "request_rate": args.request_rate, "policies": {}}
    print(f"{len(args.urls)} replicas, {kv_tokens} KV tokens in all, {tenants} tenants x {args.users_per_tenant} "
          f"users, system prompts of ~{args.system_prompt_len} tokens")
    print(f"{'policy':<14}{'out tok/s':>10}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}"
          f"{'failed':>7}  per replica")
    for index, policy in enumerate(args.policies):
        summary = await run_policy(args, policy, args.seed + index, tenants, model)
        report["policies"][policy] = summary
        print(f"{policy:<14}{summary['output_tok_per_s']:>10.0f}{summary['prefix_hit_rate']:>9.2f}"
              f"{summary['ttft_ms'].get('p50', math.nan):>10.1f}{summary['ttft_ms'].get('p90', math.nan):>10.1f}"
              f"{summary['tpot_ms'].get('p50', math.nan):>10.2f}{summary['failed']:>7}  {summary['requests_per_replica']}")
    policies = report["policies"]
    if {"cache_aware", "round_robin"} <= set(policies):
        aware, robin = policies["cache_aware"], policies["round_robin"]
        report["cache_aware_over_round_robin"] = {
            "output_tok_per_s": aware["output_tok_per_s"] / robin["output_tok_per_s"],
            "ttft_p90": aware["ttft_ms"]["p90"] / robin["ttft_ms"]["p90"]}
        print("cache_aware / round_robin:", {k: round(v, 3) for k, v in report["cache_aware_over_round_robin"].items()})
    if args.overhead_requests:
        report["router_overhead_ttft_ms"] = overhead = await router_overhead(args, model)
        print("batch-1 TTFT p50 ms: direct {:.2f}, through SMG {:.2f}, direct again {:.2f}: SMG adds {:.2f}".format(
            overhead["direct"]["p50"], overhead["smg"]["p50"], overhead["direct_again"]["p50"],
            overhead["added_p50_ms"]))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", nargs="+", required=True, metavar="URL=GRPC",
                        help="each replica's gateway URL and scheduler address, joined by '='")
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument("--kv-fill", type=float, default=0.7, help="share of the combined KV the system prompts fill")
    parser.add_argument("--tenants", type=int, default=0, help="0: from --kv-fill")
    parser.add_argument("--users-per-tenant", type=int, default=6)
    parser.add_argument("--system-prompt-len", type=int, default=2000, help="words (about tokens) per system prompt")
    parser.add_argument("--question-len", type=int, nargs=2, default=[20, 80])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--overhead-requests", type=int, default=50, help="0: skip the batch-1 TTFT comparison")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("bench/out/smg.log"))
    parser.add_argument("--out", type=Path, default=Path("bench/out/router_prefix.json"))
    args = parser.parse_args(argv)
    args.urls = [pair.split("=")[0] for pair in args.replicas]
    args.addresses = [pair.split("=")[1] for pair in args.replicas]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = asyncio.run(benchmark(args))
    report["seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
