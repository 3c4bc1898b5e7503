"""Online serving benchmark through the public gRPC API (issue 15; DESIGN §8 "online"), after vLLM's
serving benchmark: requests arrive as a Poisson process at each given rate (`inf`: all at once), with
prompt and output lengths drawn uniformly from ranges (and an optional prefix every prompt shares);
each request's time to first token, time per output token, inter-token latencies and end-to-end
latency, then p50/p90/p99, throughput and goodput (requests per second that meet the SLO).

    python3 bench/serve.py                          # starts `nanoserve up` on the demo model (CPU works)
    python3 bench/serve.py --model DIR              # ... on a checkpoint (e.g. on the GPU machine)
    python3 bench/serve.py --address HOST:PORT      # against a server that is already running
    python3 bench/serve.py --model DIR --request-rates 8 32 --num-prompts 1000   # DESIGN's online workload

Every rate gets prompts of its own (fresh random token ids), so no rate is served from the cache of
another; only the shared prefix (--shared-prefix-len) is meant to hit. The server's own step counters
(GetStats: prefill, decode and mixed steps, rank 0's busy time) are reported beside each rate.

Other benches import the parts: make_requests and arrival_times (the workload), run_request (one
request, measured), run_rate and summarize. A target is anything with `stream(request)`, an async
iterator of the token count of each message the server streams back, and `stats()`; GrpcTarget is
the gRPC one, OpenAITarget the OpenAI HTTP API of the gateway (issue 19), and open_target is where the
command line picks one.

Through the gateway (streamed /v1/completions with token-id prompts, counting each event's tokens by
vLLM's `return_token_ids`), and beside the same requests over gRPC with --compare-grpc:

    python3 bench/serve.py --model DIR --openai --compare-grpc --request-rates inf --num-prompts 256 \
        --input-len 100 1024 --output-len 100 1024        # DESIGN's throughput workload, both APIs
    python3 bench/serve.py --model DIR --openai --compare-grpc --request-rates 1 --max-concurrency 1 \
        --num-prompts 50 --input-len 512 512 --output-len 1 1   # batch-1 TTFT: what the gateway adds
    python3 bench/serve.py --openai http://HOST:8000 [--address HOST:PORT]   # a running gateway
    python3 bench/serve.py --model DIR --openai --api-server-count 4 --compare-grpc ...   # 4 gateway processes

Behind a router that takes text prompts only (SMG, in front of `nanoserve up --data-parallel-size N`),
`--text-prompts DIR` sends each prompt as its ids decoded by DIR's tokenizer, and `--replicas ADDR...`
(the replicas' schedulers) reports how many of each rate's requests each replica finished and the prefix
hit rate over all of them (hit tokens over prompt tokens). The multi-tenant prefix workload (`--tenants T --users U --rounds R`): T system prompts of --system-len
tokens, each followed by the questions of U users (--input-len tokens each), every user asking once a
round for R rounds, in random order within a round, at the given rates; every rate has the same
tenants (from --seed) asking new questions, after each tenant has asked once (the warm-up):

    python3 bench/serve.py --openai http://HOST:8000 --text-prompts DIR --tenants 24 --users 8 --rounds 4 \
        --system-len 4096 --input-len 64 64 --output-len 64 64 --request-rates 32

One Python client process takes some tens of thousands of streamed messages a second; above that,
`--client-processes N` sends the requests from N processes on one arrival schedule and merges their
results (bench/client_processes.py). Every rate reports each process's CPU seconds per second
(`client.cpu_per_wall`): near 1, the client was the limit.

`--openai` alone starts a gateway in front of the scheduler; `--null-worker` serves from a scheduler over
a worker that computes nothing, so what is measured is the services' own cost (CPU is enough). On the GPU machine, whose image has no HTTP
stack, carry the gateway's wheels in .whl/ (pip download --no-deps --only-binary=:all:
--python-version 3.12 --platform manylinux2014_x86_64 of fastapi, starlette, pydantic, pydantic-core,
annotated-types, annotated-doc, typing-inspection, typing-extensions, uvicorn, click, h11, anyio, idna,
at the versions requirements*.txt pin) and install them with --no-deps; aiohttp, the client, is there.
"""
import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Protocol

import aiohttp
import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from client_processes import ClientProcesses  # noqa: E402
from latency import percentiles, start_server  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_http_ok  # noqa: E402
from service_overhead import null_service  # noqa: E402
from nanoserve.client import make_request  # noqa: E402
from nanoserve.v1 import llm_pb2, llm_pb2_grpc  # noqa: E402
from nanoserve.wire import GRPC_OPTIONS  # noqa: E402

# Stats counters whose change over a rate's run is reported with it.
STEP_COUNTERS = ("prefill_steps", "decode_steps", "mixed_steps", "prefill_tokens", "decode_tokens",
                 "mixed_decode_tokens", "prefill_busy_seconds", "decode_busy_seconds")


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """One request as the client saw it; seconds, from the moment it was sent."""
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between tokens after the first
    e2e: float | None = None
    error: str = ""
    messages: int = 0  # streamed messages (SSE events) received, the client's unit of work

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class RequestFailed(Exception):
    """The server ended a request with an error; the message says which."""


class Target(Protocol):
    def stream(self, request: BenchRequest) -> AsyncIterator[int]: ...  # tokens per streamed message
    async def stats(self) -> dict[str, float]: ...  # the server's counters; {} where it has none


def make_requests(count: int, input_len: tuple[int, int], output_len: tuple[int, int], shared_prefix_len: int = 0,
                  seed: int = 0, vocab: int = 10000) -> list[BenchRequest]:
    """Prompts of random token ids in [0, vocab] (DESIGN §8) whose lengths, and output lengths, are
    uniform in the inclusive ranges; each prompt starts with the same shared_prefix_len ids."""
    rng = random.Random(seed)
    prefix = [rng.randint(0, vocab) for _ in range(shared_prefix_len)]
    return [BenchRequest(prefix + [rng.randint(0, vocab) for _ in range(rng.randint(*input_len))],
                         rng.randint(*output_len)) for _ in range(count)]


def make_tenant_requests(tenants: int, users: int, system_len: int, input_len: tuple[int, int],
                         output_len: tuple[int, int], seed: int = 0, vocab: int = 10000, rounds: int = 1,
                         question_seed: int | None = None) -> list[BenchRequest]:
    """Each of `tenants` system prompts of system_len random ids (drawn from `seed`), followed by the
    questions of `users` users (input_len ids each, drawn from question_seed, default `seed`): every
    (tenant, user) asks once a round, in random order within the round, round after round. The same
    seed with another question_seed gives the same tenants asking new questions."""
    rng = random.Random(seed)
    systems = [[rng.randint(0, vocab) for _ in range(system_len)] for _ in range(tenants)]
    if question_seed is not None:
        rng = random.Random(question_seed)
    requests = []
    for _ in range(rounds):
        round_ = [BenchRequest(system + [rng.randint(0, vocab) for _ in range(rng.randint(*input_len))],
                               rng.randint(*output_len)) for system in systems for _ in range(users)]
        rng.shuffle(round_)
        requests += round_
    return requests


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `rate` requests
    per second (exponential gaps, the first at 0); all at 0 when rate is infinite."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_request(target: Target, request: BenchRequest,
                      clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Sends one request and times its stream. A message of k tokens after the first message counts
    as k equal gaps since the message before; tokens that come with the first count in no gap."""
    result = RequestResult(len(request.prompt))
    start = last = clock()
    try:
        async for count in target.stream(request):
            now = clock()
            result.messages += 1
            if not count:
                continue
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl += [(now - last) / count] * count
            result.output_tokens += count
            last = now
        result.e2e = clock() - start
    except RequestFailed as err:
        result.error = str(err)
    return result


async def run_schedule(target: Target, requests: list[BenchRequest], times: list[float], start: float,
                       max_concurrency: int = 0) -> tuple[list[RequestResult], float]:
    """Every request sent `times` seconds after `start` (perf_counter; at most max_concurrency in
    flight, 0 = no limit): the results in request order and the perf_counter time the last one ended."""
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def send(request: BenchRequest, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            return await run_request(target, request)

    results = await asyncio.gather(*(send(r, at) for r, at in zip(requests, times)))
    return list(results), time.perf_counter()


async def run_rate(target: Target, requests: list[BenchRequest], rate: float, seed: int = 0,
                   max_concurrency: int = 0) -> tuple[list[RequestResult], float]:
    """Every request sent at its arrival time (at most max_concurrency in flight, 0 = no limit);
    the results in request order and the seconds from the first send to the last token."""
    start = time.perf_counter()
    results, end = await run_schedule(target, requests, arrival_times(len(requests), rate, seed), start,
                                      max_concurrency)
    return results, end - start


async def run_clients(target: Target, clients: ClientProcesses | None, requests: list[BenchRequest], rate: float,
                      seed: int = 0, max_concurrency: int = 0) -> tuple[list[RequestResult], float, list[float]]:
    """run_rate from this process (clients None) or from the client processes: the results in request
    order, the seconds from the first send to the last token, and each client process's CPU seconds."""
    if clients:
        return await clients.run(requests, arrival_times(len(requests), rate, seed), max_concurrency)
    cpu = time.process_time()
    results, seconds = await run_rate(target, requests, rate, seed, max_concurrency)
    return results, seconds, [time.process_time() - cpu]


def client_load(cpu_seconds: list[float], seconds: float, messages: int) -> dict:
    """How busy the client was: a process near 1 CPU second per second limited what was measured."""
    return {"processes": len(cpu_seconds), "cpu_seconds": cpu_seconds,
            "cpu_per_wall": [cpu / seconds for cpu in cpu_seconds],
            "messages_per_cpu_second": messages / sum(cpu_seconds) if sum(cpu_seconds) else None}


def summarize(results: list[RequestResult], seconds: float, slo_ttft: float, slo_tpot: float) -> dict:
    """Throughput, goodput (requests per second within both SLOs, in seconds) and latency
    percentiles in milliseconds over the requests that completed."""
    done = [r for r in results if not r.error and r.ttft is not None]
    output = sum(r.output_tokens for r in done)
    good = [r for r in done if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]

    def ms(values: list[float]) -> dict[str, float]:
        return {k: (v * 1e3 if k != "n" else v) for k, v in percentiles(values).items()} if values else {}

    return {"requests": len(results), "completed": len(done), "failed": sum(1 for r in results if r.error),
            "errors": sorted({r.error for r in results if r.error})[:5], "seconds": seconds,
            "request_throughput": len(done) / seconds, "output_tok_per_s": output / seconds,
            "total_tok_per_s": (output + sum(r.prompt_tokens for r in done)) / seconds,
            "goodput_req_per_s": len(good) / seconds, "output_tokens": output,
            "stream_messages": sum(r.messages for r in results),
            "ttft_ms": ms([r.ttft for r in done]), "tpot_ms": ms([r.tpot for r in done if r.tpot is not None]),
            "itl_ms": ms([gap for r in done for gap in r.itl]), "e2e_ms": ms([r.e2e for r in done])}


class GrpcTarget:
    """The public gRPC API: Generate streams, GetStats counters."""

    def __init__(self, address: str, temperature: float, ignore_eos: bool):
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = llm_pb2_grpc.LLMStub(self.channel)
        self.sampling = dict(temperature=temperature, ignore_eos=ignore_eos)

    async def stream(self, request: BenchRequest) -> AsyncIterator[int]:
        try:
            async for msg in self.stub.Generate(make_request(request.prompt, max_tokens=request.max_tokens,
                                                             **self.sampling)):
                yield len(msg.token_ids)
        except grpc.aio.AioRpcError as err:
            raise RequestFailed(f"{err.code().name}: {err.details()}") from err

    async def stats(self) -> dict[str, float]:
        stats = await self.stub.GetStats(llm_pb2.GetStatsRequest())
        return {name: getattr(stats, name) for name in STEP_COUNTERS}

    async def describe(self) -> dict[str, str]:
        info = await self.stub.GetModelInfo(llm_pb2.GetModelInfoRequest())
        return {"model": info.model, "attention_backend": info.attention_backend}

    async def close(self) -> None:
        await self.channel.close()


class OpenAITarget:
    """The gateway's OpenAI API: streamed /v1/completions with token-id prompts; each event's tokens
    are counted from its `token_ids` (vLLM's return_token_ids), since an event's text may hold
    several tokens or none (a character not complete yet). Counters and the backend come over gRPC
    when the scheduler's address is known. The client is aiohttp's, as in vLLM's serving benchmark:
    what a client costs counts in every time measured here, and httpx's streamed request costs
    ~1.7 ms more than aiohttp's on the 2-core development machine (batch-1 TTFT over a null worker)."""

    def __init__(self, url: str, temperature: float, ignore_eos: bool, grpc_target: GrpcTarget | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        self.url = url
        self.decode = decode  # prompts as text (a router that takes no token ids), else as ids
        self.model = None  # named in every request once describe() has asked (a router needs it)
        self.session: aiohttp.ClientSession | None = None  # made on the benchmark's event loop
        self.sampling = dict(temperature=temperature, ignore_eos=ignore_eos)
        self.grpc_target = grpc_target

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(self.url, connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None))
        return self.session

    async def stream(self, request: BenchRequest) -> AsyncIterator[int]:
        prompt = self.decode(request.prompt) if self.decode else request.prompt
        body = {"model": self.model, "prompt": prompt, "max_tokens": request.max_tokens, "stream": True,
                "return_token_ids": True, **self.sampling}
        async with self._session().post("/v1/completions", json=body) as response:
            if response.status != 200:
                error = (await response.json()).get("error", {})
                raise RequestFailed(f"HTTP {response.status}: {error.get('message', '')}")
            async for line in response.content:  # line by line: an event is one line
                if line.startswith(b"data: {"):
                    yield sum(len(choice.get("token_ids", ())) for choice in json.loads(line[6:])["choices"])

    async def stats(self) -> dict[str, float]:
        return await self.grpc_target.stats() if self.grpc_target else {}

    async def describe(self) -> dict[str, str]:
        async with self._session().get("/v1/models") as response:
            self.model = (await response.json())["data"][0]["id"]
        return {**(await self.grpc_target.describe() if self.grpc_target else {}), "model": self.model,
                "api": "openai"}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.grpc_target:
            await self.grpc_target.close()


async def replica_stats(addresses: list[str]) -> list[llm_pb2.Stats]:
    """Each scheduler's GetStats, in order."""
    stats = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            stats.append(await llm_pb2_grpc.LLMStub(channel).GetStats(llm_pb2.GetStatsRequest()))
    return stats


def open_target(args: argparse.Namespace, address: str, api: str, process: int = 0) -> GrpcTarget | OpenAITarget:
    """The API the benchmark drives: "grpc" (the scheduler at `address`) or "openai" (the gateway at
    args.openai, with the scheduler's counters when `address` is known); of several gateways, client
    process `process` drives the one at its index modulo their number."""
    grpc_target = GrpcTarget(address, args.temperature, not args.no_ignore_eos) if address else None
    if api == "grpc":
        return grpc_target
    decode = None
    if args.text_prompts:
        from tokenizers import Tokenizer

        decode = Tokenizer.from_file(str(Path(args.text_prompts) / "tokenizer.json")).decode
    urls = args.openai.split(",")
    return OpenAITarget(urls[process % len(urls)], args.temperature, not args.no_ignore_eos, grpc_target, decode)


def workload(args: argparse.Namespace, seed: int, count: int) -> list[BenchRequest]:
    """`count` requests of the workload the flags describe (the tenants' ignore `count`: every rate has
    the same tenants, from --seed, asking questions of its own, from `seed`)."""
    if args.tenants:
        return make_tenant_requests(args.tenants, args.users, args.system_len, tuple(args.input_len),
                                    tuple(args.output_len), args.seed, rounds=args.rounds, question_seed=seed)
    return make_requests(count, tuple(args.input_len), tuple(args.output_len), args.shared_prefix_len, seed)


async def run_rates(args: argparse.Namespace, target: GrpcTarget | OpenAITarget, label: str,
                    clients: ClientProcesses | None = None) -> dict:
    """A warm-up, then each rate's run (from the client processes when there are some): its summary by rate."""
    rates = {}
    warmup = make_requests(args.warmup, tuple(args.input_len), tuple(args.output_len), args.shared_prefix_len,
                           seed=args.seed + 10_000)
    await run_clients(target, clients, warmup, math.inf)  # first steps of each kind, connections, the shared prefix
    if args.tenants:  # each tenant asks once first: the timed rates then see a deployment's steady state, where
        # every system prompt has been served before, not each prompt's first prefill under both policies
        await run_clients(target, clients, make_tenant_requests(
            args.tenants, 1, args.system_len, tuple(args.input_len), tuple(args.output_len), args.seed,
            question_seed=args.seed + 10_000), math.inf)
    for index, rate in enumerate(args.request_rates):
        requests = workload(args, args.seed + index, args.num_prompts)
        before, replicas_before = await target.stats(), await replica_stats(args.replicas)
        results, seconds, cpu_seconds = await run_clients(target, clients, requests, rate, args.seed + index,
                                                          args.max_concurrency)
        after, replicas_after = await target.stats(), await replica_stats(args.replicas)
        summary = summarize(results, seconds, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        summary["client"] = client_load(cpu_seconds, seconds, summary["stream_messages"])
        summary["server_steps"] = {name: after[name] - before[name] for name in after}
        if args.replicas:  # where the router sent this rate's requests, and what all replicas found cached
            summary["requests_per_replica"] = [a.requests_finished - b.requests_finished
                                               for a, b in zip(replicas_after, replicas_before)]
            hit, prompt = (sum(getattr(a, name) - getattr(b, name) for a, b in zip(replicas_after, replicas_before))
                           for name in ("prefix_cache_hit_tokens", "prompt_tokens_total"))
            summary["prefix_hit_rate"] = hit / prompt if prompt else None
        rates[format_rate(rate)] = summary
        print_row(f"{label}{format_rate(rate)}", summary)
    return rates


async def benchmark(args: argparse.Namespace, address: str) -> dict:
    apis = ["openai", "grpc"] if args.openai and args.compare_grpc else ["openai" if args.openai else "grpc"]
    report = {"address": address, "openai": args.openai or None, "api_server_count": args.api_server_count,
              "num_prompts": args.num_prompts, "client_processes": args.client_processes,
              "workload": dict(input_len=args.input_len, output_len=args.output_len,
                               shared_prefix_len=args.shared_prefix_len, tenants=args.tenants, users=args.users,
                               rounds=args.rounds, system_len=args.system_len, text_prompts=bool(args.text_prompts)),
              "temperature": args.temperature, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}}
    for api in apis:
        target = open_target(args, address, api)
        clients = None
        try:
            report.update(await target.describe())
            if args.client_processes > 1:
                clients = ClientProcesses(args.client_processes, functools.partial(open_target, args, address, api),
                                          run_schedule)
            report["rates" if api == apis[0] else "grpc_rates"] = await run_rates(
                args, target, "grpc " if api == "grpc" and len(apis) > 1 else "", clients)
        finally:
            if clients:
                clients.close()
            await target.close()
    if len(apis) > 1:  # what the gateway costs: its throughput over gRPC's, its TTFT p50 beyond gRPC's
        report["openai_vs_grpc"] = {rate: {
            "output_tok_per_s_ratio": s["output_tok_per_s"] / report["grpc_rates"][rate]["output_tok_per_s"],
            "ttft_p50_added_ms": s["ttft_ms"]["p50"] - report["grpc_rates"][rate]["ttft_ms"]["p50"]}
            for rate, s in report["rates"].items()}
    return report


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def print_header() -> None:
    print(f"{'rate':>6} {'done':>6} {'req/s':>7} {'out tok/s':>10} {'goodput':>8}  "
          f"{'TTFT ms p50/p90/p99':>22}  {'TPOT ms p50/p90/p99':>22}  {'ITL ms p50/p90/p99':>22}  "
          f"{'E2E s p50/p99':>14} {'client CPU':>10}")


def print_row(rate: str, s: dict) -> None:
    def three(d: dict, scale: float = 1.0) -> str:
        return "/".join(f"{d[k] * scale:.1f}" for k in ("p50", "p90", "p99")) if d else "-"

    e2e = f"{s['e2e_ms']['p50'] / 1e3:.2f}/{s['e2e_ms']['p99'] / 1e3:.2f}" if s["e2e_ms"] else "-"
    print(f"{rate:>6} {s['completed']:>6} {s['request_throughput']:>7.2f} {s['output_tok_per_s']:>10.1f} "
          f"{s['goodput_req_per_s']:>8.2f}  {three(s['ttft_ms']):>22}  {three(s['tpot_ms']):>22}  "
          f"{three(s['itl_ms']):>22}  {e2e:>14} {max(s['client']['cpu_per_wall']):>10.2f}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="", help="a running server; default: start `nanoserve up`")
    p.add_argument("--model", default="", help="checkpoint for the started server; default: the demo model")
    p.add_argument("--max-model-len", type=int, default=4096, help="the started server's; 0: the model's own")
    p.add_argument("--extra", default="", help="more `nanoserve up` flags, space separated")
    p.add_argument("--request-rates", type=float, nargs="+", default=[8.0, 32.0],
                   help="requests per second, one run each; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=500, help="requests per rate")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 512], metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--tenants", type=int, default=0, help="the multi-tenant workload: this many system prompts")
    p.add_argument("--users", type=int, default=8, help="with --tenants: users (requests) per system prompt")
    p.add_argument("--system-len", type=int, default=4096, help="with --tenants: tokens per system prompt")
    p.add_argument("--rounds", type=int, default=1, help="with --tenants: questions per user, one a round")
    p.add_argument("--text-prompts", default="", metavar="DIR",
                   help="with --openai: send prompts as text, decoded by DIR's tokenizer.json (for SMG)")
    p.add_argument("--replicas", nargs="+", default=[], metavar="HOST:PORT",
                   help="with --openai at a router: the schedulers behind it; each rate reports the requests "
                   "each one finished and their prefix hit rate")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--no-ignore-eos", action="store_true", help="let eos end a request before its output length")
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight; 0 = no limit")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes that send the requests between them (bench/client_processes.py): one "
                   "Python process takes some tens of thousands of streamed messages a second")
    p.add_argument("--warmup", type=int, default=4, help="requests sent together before the timed runs")
    p.add_argument("--slo-ttft-ms", type=float, default=200.0)
    p.add_argument("--slo-tpot-ms", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--openai", nargs="?", const="start", default="",
                   help="drive the OpenAI API of a gateway at this URL; alone: start one in front of the scheduler; "
                   "URL,URL,...: several replicas' gateways with no router, client process i driving URL i mod "
                   "their number (--client-processes a multiple of it)")
    p.add_argument("--null-worker", action="store_true",
                   help="serve with a scheduler over a worker that computes nothing (CPU): the services' own costs")
    p.add_argument("--api-server-count", type=int, default=1, help="processes of the gateway --openai starts")
    p.add_argument("--compare-grpc", action="store_true",
                   help="with --openai, also run every rate over gRPC on the same server, and compare")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "serve.json"))
    args = p.parse_args(argv)
    if args.compare_grpc and not args.openai:
        p.error("--compare-grpc compares the --openai runs with gRPC: give --openai")
    if args.openai not in ("", "start") and args.compare_grpc and not args.address:
        p.error("--compare-grpc against a running gateway needs its scheduler's --address")
    if args.openai.count(",") and args.client_processes % (args.openai.count(",") + 1):
        p.error("--openai with several URLs: --client-processes must be a multiple of their number")
    if args.client_processes < 1 or args.max_concurrency % args.client_processes:
        p.error("--client-processes must be >= 1 and divide --max-concurrency (each process takes an equal part)")
    if args.null_worker and args.address:
        p.error("--null-worker starts its own scheduler: leave out --address")
    for name in ("input_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {low} {high}")
    if any(not rate > 0 for rate in args.request_rates):
        p.error("--request-rates must be positive (inf = all at once)")
    return args


@contextlib.contextmanager
def started_server(args: argparse.Namespace) -> Iterator[str]:
    """`nanoserve up` on the model, or with --null-worker a scheduler over a worker that computes
    nothing: the scheduler's address while it runs."""
    if args.null_worker:
        with null_service(str(cache_dir() / "tokenizer-qwen3")) as address:
            yield address
        return
    proc, address = start_server(args)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def started_gateway(address: str, processes: int = 1) -> Iterator[str]:
    """The OpenAI gateway in front of the scheduler at `address`, as `nanoserve gateway` runs it: its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                    os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "gateway_svc", "--scheduler", address, "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning", "--api-server-count", str(processes)], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", [proc], timeout=120)
        yield url
    finally:
        stop_all([proc])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.ExitStack() as running:
        running_gateway = args.openai not in ("", "start")  # its scheduler's counters only with --address
        address = args.address or ("" if running_gateway else running.enter_context(started_server(args)))
        if args.openai == "start":
            args.openai = running.enter_context(started_gateway(address, args.api_server_count))
        elif args.openai:
            for url in args.openai.split(","):
                wait_http_ok(url + "/health", [], timeout=120)
        print_header()
        report = asyncio.run(benchmark(args, address))
    report["command"] = " ".join(sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
