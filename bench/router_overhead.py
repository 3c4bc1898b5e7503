"""What the SMG router adds to the time to first token at low load (issue 36: <= 2 ms), on CPU or on
a GPU host. One request at a time: each round sends a request straight to a replica's gateway and one
through SMG (the order alternating from round to round, every request a prompt of its own), and the
added time is the median over rounds of the difference, so a slow spell of the machine falls on both.
Two times a request: to the response's headers, and to its first token (the first SSE event that
carries token ids).

Two direct baselines, where SMG has several replicas: `one` (always replica 0) and `spread` (the
replicas in turn, as SMG's policies spread one request at a time). They differ where a replica that
gets every N-th request answers it slower than one kept busy (an idle GPU and host clock down): that
is the replicas' doing, not the router's.

Backends (--backend):
  nanoserve  N replicas of a scheduler over a worker that computes nothing, each with its gateway
             (bench/service_overhead.py): the router's cost on top of nanoserve's own, CPU is enough;
  echo       N minimal HTTP servers (aiohttp) that answer /v1/completions with one event at once:
             SMG's own cost, nothing of nanoserve in it;
  or --gateways URL...: running gateways (e.g. those of `nanoserve up --data-parallel-size N`).
SMG runs as `up` runs it (nanoserve_cli/router.py), once for each --policies entry, or --router URL
is a running one.

    python3 bench/router_overhead.py                                   # CPU: nanoserve, 1 replica
    python3 bench/router_overhead.py --backend echo --policies cache_aware round_robin
    python3 bench/router_overhead.py --replicas 2 --prompt-tokens 16 512 4000
    python3 bench/router_overhead.py --gateways http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --router http://127.0.0.1:8000 --tokenizer DIR --requests 150 --output-tokens 16   # a GPU host
"""
import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from latency import percentiles  # noqa: E402
from router_prefix import start_smg  # noqa: E402
from serve import started_gateway  # noqa: E402
from service_overhead import null_service  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_http_ok  # noqa: E402

ECHO_MODEL = "echo"
# its id: the wall time the request arrived (bench/burst_arrival.py reads it)
ECHO_EVENT = (b'data: {"id":"echo-%.6f","object":"text_completion",'
              b'"choices":[{"index":0,"text":"x","token_ids":[5]}]}\n\n')


@dataclass(frozen=True)
class Timing:
    headers: float      # seconds from sending to the response's headers
    first_token: float  # ... to the first event that carries token ids


async def timed_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                        max_tokens: int) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        headers = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:200]}")
        first = None
        async for line in response.content:
            if first is None and line.startswith(b"data: {") and any(
                    choice.get("token_ids") for choice in json.loads(line[6:])["choices"]):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return Timing(headers, first)


def text_prompts(tokenizer_dir: str | None, count: int, tokens: int, seed: int) -> list[str]:
    """`count` prompts of about `tokens` tokens: random ids as text, re-tokenized and cut to length (as
    bench/serve.py --text-prompts sends them); for the echo backend, random words."""
    rng = random.Random(seed)
    if tokenizer_dir is None:
        return [" ".join(f"w{rng.randint(0, 9999)}" for _ in range(tokens)) for _ in range(count)]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    texts = (tokenizer.decode([rng.randint(0, 10000) for _ in range(tokens)]) for _ in range(count))
    return [tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids[:tokens]) for text in texts]


async def compare(args: argparse.Namespace, gateways: list[str], router: str, model: str, tokens: int,
                  seed: int) -> dict:
    """Rounds of a request straight to a replica (each baseline) and one through the router, the
    order rotating; per path the percentiles, and the router's added time per baseline."""
    paths = ["one", "spread", "router"] if len(gateways) > 1 else ["one", "router"]
    rounds = args.warmup + args.requests
    prompts = iter(text_prompts(args.tokenizer, rounds * len(paths), tokens, seed))
    times: dict[str, list[Timing]] = {path: [] for path in paths}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for index in range(rounds):
            url = {"one": gateways[0], "spread": gateways[index % len(gateways)], "router": router}
            shift = index % len(paths)
            for path in paths[shift:] + paths[:shift]:
                timing = await timed_request(session, url[path], model, next(prompts), args.output_tokens)
                if index >= args.warmup:
                    times[path].append(timing)

    def ms(values: list[float]) -> dict[str, float]:
        return {key: value * 1e3 if key != "n" else value for key, value in percentiles(values).items()}

    report = {path: {"first_token_ms": ms([t.first_token for t in timings]),
                     "headers_ms": ms([t.headers for t in timings])} for path, timings in times.items()}
    for baseline in paths[:-1]:
        report[f"added_over_{baseline}_ms"] = {
            what: 1e3 * statistics.median(getattr(r, what) - getattr(d, what)
                                          for r, d in zip(times["router"], times[baseline]))
            for what in ("first_token", "headers")}
    return report


@contextlib.contextmanager
def smg(gateways: list[str], policy: str, log: Path) -> Iterator[str]:
    """SMG in front of the gateways as `nanoserve up --data-parallel-size N` runs it: its URL."""
    proc, url = start_smg(gateways, policy, log)
    try:
        yield url
    finally:
        stop_all([proc])


@contextlib.contextmanager
def backends(args: argparse.Namespace) -> Iterator[tuple[list[str], str]]:
    """The replicas' URLs and the model they serve, started here unless --gateways names them."""
    if args.gateways:
        for url in args.gateways:
            wait_http_ok(url + "/health", [], timeout=120)
        yield args.gateways, model_of(args.gateways[0])
        return
    with contextlib.ExitStack() as running:
        if args.backend == "echo":
            urls = running.enter_context(echo_backends(args.replicas, args.echo_delay_ms))
        else:
            urls = [running.enter_context(started_gateway(running.enter_context(null_service(args.tokenizer))))
                    for _ in range(args.replicas)]
        yield urls, model_of(urls[0])


@contextlib.contextmanager
def echo_backends(count: int, delay_ms: float = 0.0) -> Iterator[list[str]]:
    """`count` echo backends (serve_echo), each a process of its own: their URLs while they run."""
    ports = [free_port() for _ in range(count)]
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-echo", str(port), "--echo-delay-ms", str(delay_ms)])
             for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_http_ok(url + "/health", procs, timeout=60)
        yield urls
    finally:
        stop_all(procs)


def model_of(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


def serve_echo(port: int, delay_ms: float) -> None:
    """A minimal OpenAI-shaped server: what SMG asks of a worker, and completions that stream one
    token event and [DONE] after delay_ms. It queues as many new connections as a gateway's uvicorn."""
    async def completions(request: web.Request) -> web.StreamResponse:
        arrived = time.time()
        await request.read()
        await asyncio.sleep(delay_ms / 1e3)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(ECHO_EVENT % arrived + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def loads(request: web.Request) -> web.Response:
        return web.json_response({"dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": 0,
                                                                  "num_waiting_reqs": 0, "num_total_reqs": 0}]})

    app = web.Application()
    app.router.add_get("/health", lambda request: web.Response())
    app.router.add_get("/v1/models", lambda request: web.json_response(
        {"object": "list", "data": [{"id": ECHO_MODEL, "object": "model", "owned_by": "echo"}]}))
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=2048)


def print_row(policy: str, tokens: int, r: dict) -> None:
    baselines = [key for key in r if key.startswith("added_over_")]
    added = "  ".join(f"{key[11:-3]} {r[key]['first_token']:+.2f} (headers {r[key]['headers']:+.2f})"
                      for key in baselines)
    direct = r["one"]["first_token_ms"]["p50"]
    print(f"{policy:<13}{tokens:>7}{direct:>10.2f}{r['router']['first_token_ms']['p50']:>10.2f}   {added}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("nanoserve", "echo"), default="nanoserve")
    p.add_argument("--replicas", type=int, default=1, help="backends started here")
    p.add_argument("--gateways", nargs="+", default=[], metavar="URL", help="running gateways instead")
    p.add_argument("--router", default="", help="a running router in front of --gateways instead of SMG started here")
    p.add_argument("--policies", nargs="+", default=["cache_aware"], help="SMG's --policy, one run each")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512])
    p.add_argument("--output-tokens", type=int, default=1)
    p.add_argument("--requests", type=int, default=100, help="rounds measured (each one request per path)")
    p.add_argument("--warmup", type=int, default=5, help="rounds first, not measured")
    p.add_argument("--tokenizer", default="", help="tokenizer.json's folder; default: the demo model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=REPO / "bench" / "out" / "router_overhead.smg.log")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "router_overhead.json")
    p.add_argument("--echo-delay-ms", type=float, default=0.0,
                   help="the echo backend answers after this long (as a replica's prefill would)")
    p.add_argument("--serve-echo", type=int, default=0, help=argparse.SUPPRESS)  # an echo backend's process
    args = p.parse_args(argv)
    if args.router and not args.gateways:
        p.error("--router needs the --gateways behind it")
    if "power_of_two" in args.policies and not args.router and (len(args.gateways) or args.replicas) < 2:
        p.error("SMG's power_of_two policy needs at least 2 replicas")
    if args.backend == "echo" and not args.gateways:
        args.tokenizer = None  # its prompts are words: it reads nothing
    else:
        args.tokenizer = args.tokenizer or str(cache_dir() / "tokenizer-qwen3")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve_echo:
        serve_echo(args.serve_echo, args.echo_delay_ms)
        return
    args.log.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(sys.argv), "backend": "running" if args.gateways else args.backend,
              "echo_delay_ms": args.echo_delay_ms, "output_tokens": args.output_tokens, "requests": args.requests,
              "runs": []}
    print(f"{'policy':<13}{'tokens':>7}{'direct':>10}{'via SMG':>10}   added TTFT p50 ms, per baseline")
    with backends(args) as (gateways, model):
        report["replicas"] = len(gateways)
        for policy in [""] if args.router else args.policies:
            with contextlib.nullcontext(args.router) if args.router else smg(gateways, policy, args.log) as router:
                for index, tokens in enumerate(args.prompt_tokens):
                    run = asyncio.run(compare(args, gateways, router, model, tokens, args.seed + index))
                    report["runs"].append({"policy": policy or "running", "prompt_tokens": tokens, **run})
                    print_row(policy or "running", tokens, run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
