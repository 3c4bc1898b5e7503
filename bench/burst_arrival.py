"""A burst of streamed requests whose connections all open at once, straight to a replica's gateway and
through SMG: when each connection was established, when its scheduler took the request and when its
first token came (issue 36: N replicas through SMG >= 0.95 x N x one replica).

Two replicas through SMG lost ~12% of twice one replica's throughput on the throughput workload
(docs/scale-out.md), all of it at the start of the burst: the requests reached the replicas spread over
about a second. SMG listens with a 128-connection accept queue; a burst of new connections larger than
what it accepts meanwhile overflows it, the kernel drops those SYNs, and each client tries again after
its initial retransmission timeout, one second. `up` deepens that queue (nanoserve_cli/smg_router.py).
This bench shows the burst each way:

  direct    N requests to replica 0's gateway (uvicorn listens with 2,048);
  smg       N x R requests through SMG as `up` runs it (its queue deepened);
  smg-own   the same through SMG's own launcher with up's flags (its queue at 128).

Each round opens the connections in a tight loop (as many clients, or a benchmark's client processes on
a many-core host, do at once; one Python client making its connections one by one is too slow to
overflow anything), then sends one streamed /v1/completions on each (HTTP/1.0: the stream ends with
the connection) with a prompt as text of the throughput workload's length. Per path: how many
connections took over half a second to be established (a dropped SYN waits a second), the kernel's
ListenOverflows over the round (this network namespace's total: run it in `unshare -rn` for a count of
its own), and per request, from the moment its connect() was called, its arrival at the scheduler (the
scheduler's "request finished" line: its time less the request's duration) and its first token.

Backends: schedulers over a worker that computes nothing (bench/service_overhead.py), each with its
gateway (--backend nanoserve, CPU is enough: the services' and the router's handling of the burst); or
minimal HTTP servers that answer at once and put each request's arrival in their event's id (--backend
echo: SMG's part alone); or running replicas (--gateways, with --scheduler-logs where their schedulers'
lines are, e.g. `nanoserve up`'s log). `--serve-router PORT` only runs another SMG in front of --gateways
until stopped (--launcher up or own, --policy), for bench/gpu_scaleout.sh to benchmark through.

    python3 bench/burst_arrival.py                             # 1 replica, 512 connections a path
    unshare -rn python3 bench/burst_arrival.py --backend echo --replicas 2 --connections 256 --policy round_robin
    python3 bench/burst_arrival.py --gateways http://127.0.0.1:8001 http://127.0.0.1:8002 --scheduler-logs up.log
"""
import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from latency import percentiles  # noqa: E402
from router_overhead import echo_backends, model_of  # noqa: E402
from serve import make_requests, started_gateway  # noqa: E402
from service_overhead import null_service  # noqa: E402
from nanoserve.flags import defaults  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all  # noqa: E402
from nanoserve_cli.router import router_command, wait_routing  # noqa: E402

FINISHED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*request finished id=(\S+) .*duration=([\d.]+)s")
SLOW_CONNECT = 0.5  # seconds: an established connection this late waited for a SYN retransmission


@dataclass
class Stream:
    """One request's times (wall clock, seconds) and the id its gateway gave it."""
    opened: float             # connect() called
    established: float = 0.0
    first_token: float = 0.0
    request_id: str = ""
    arrived: float = 0.0      # at the scheduler (from its log) or at the echo backend


def listen_overflows() -> int:
    """The kernel's count of connections dropped from a full accept queue (this network namespace)."""
    rows = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines() if line.startswith("TcpExt:")]
    return int(dict(zip(rows[0], rows[1]))["ListenOverflows"])


def open_all(port: int, count: int) -> list[tuple[socket.socket, Stream]]:
    """`count` connections to 127.0.0.1:port, their connect() called back to back (non-blocking)."""
    opened = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        stream = Stream(time.time())
        sock.connect_ex(("127.0.0.1", port))
        opened.append((sock, stream))
    return opened


async def established(sock: socket.socket) -> None:
    """Returns once the socket's connect completed (it turns writable), or raises its error."""
    loop = asyncio.get_running_loop()
    writable = loop.create_future()
    loop.add_writer(sock, writable.set_result, None)
    try:
        await writable
    finally:
        loop.remove_writer(sock)
    if error := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        raise OSError(error, os.strerror(error))


async def stream_one(sock: socket.socket, stream: Stream, body: bytes) -> None:
    """One streamed completion on an opening connection: the stream's times and request id."""
    await established(sock)
    stream.established = time.time()
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read())[:300].decode(errors='replace')}")
    async for line in reader:  # the headers, then the events until the server closes
        if line.startswith(b"data: {") and not stream.first_token:
            stream.first_token = time.time()
            stream.request_id = json.loads(line[6:])["id"]
            if stream.request_id.startswith("echo-"):  # an echo backend's: the time the request arrived
                stream.arrived = float(stream.request_id[5:])
    writer.close()


async def burst(port: int, bodies: list[bytes]) -> list[Stream]:
    opened = open_all(port, len(bodies))
    await asyncio.gather(*(stream_one(sock, stream, body) for (sock, stream), body in zip(opened, bodies)))
    return [stream for _, stream in opened]


def read_arrivals(logs: list[Path], streams: list[Stream]) -> None:
    """Each stream's arrival at its scheduler: the time of its "request finished" line less its duration."""
    by_id = {stream.request_id: stream for stream in streams}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if (match := FINISHED.search(line)) and match[2] in by_id:
                logged = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                by_id[match[2]].arrived = logged - float(match[3])


def summarize(streams: list[Stream], overflows: int) -> dict:
    def ms(values: list[float]) -> dict[str, float]:
        return {key: value * 1e3 if key != "n" else value for key, value in percentiles(values).items()}

    arrived = [s for s in streams if s.arrived]
    start = min(s.opened for s in streams)
    return {"connections": len(streams), "listen_overflows": overflows,
            "slow_connects": sum(s.established - s.opened > SLOW_CONNECT for s in streams),
            "connect_ms": ms([s.established - s.opened for s in streams]),
            "arrival_ms": ms([s.arrived - s.opened for s in arrived]),
            "arrival_spread_ms": 1e3 * (max(s.arrived for s in arrived) - min(s.arrived for s in arrived)),
            "first_token_ms": ms([s.first_token - s.opened for s in streams]),
            "last_arrival_after_start_ms": 1e3 * (max(s.arrived for s in arrived) - start),
            "arrivals_found": len(arrived)}


@contextlib.contextmanager
def router(gateways: list[str], policy: str, own_launcher: bool, log: Path, port: int = 0) -> Iterator[int]:
    """SMG in front of the gateways with up's flags, through up's launcher or SMG's own: its port."""
    port = port or free_port()
    up = argparse.Namespace(host="127.0.0.1", openai_port=port, router_policy=policy, shutdown_timeout=5,
                            max_num_seqs=defaults("up")["max_num_seqs"])
    command = router_command(up, gateways, free_port())
    if own_launcher:
        command[2] = "smg.launch_router"  # python -m smg.launch_router, the same flags
    with log.open("ab") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_routing(f"http://127.0.0.1:{port}", len(gateways), lambda: proc.poll() is None, 60)
        yield port
    finally:
        stop_all([proc])


@contextlib.contextmanager
def backends(args: argparse.Namespace) -> Iterator[tuple[list[str], list[Path]]]:
    """The replicas' gateway URLs and their schedulers' logs: --gateways and --scheduler-logs, else
    replicas started here: echo backends (their events carry the arrival: no log), or null replicas,
    each scheduler logging to a file beside --out."""
    if args.gateways:
        yield args.gateways, args.scheduler_logs
        return
    if args.backend == "echo":
        with echo_backends(args.replicas) as urls:
            yield urls, []
        return
    logs = [args.out.with_suffix(f".scheduler{d}.log") for d in range(args.replicas)]
    with contextlib.ExitStack() as running:
        for log in logs:
            log.write_bytes(b"")
        yield [running.enter_context(started_gateway(running.enter_context(
            null_service(args.tokenizer, "", args.step_ms, log=log)))) for log in logs], logs


def run_paths(args: argparse.Namespace, gateways: list[str], logs: list[Path]) -> list[dict]:
    """Each round a burst down each path, the paths' order rotating: each burst's summary."""
    runs = []
    with contextlib.ExitStack() as running:
        ports = {"direct": int(gateways[0].rsplit(":", 1)[1])}
        for path in set(args.paths) - {"direct"}:
            ports[path] = running.enter_context(router(gateways, args.policy, path == "smg-own",
                                                       args.out.with_suffix(".smg.log")))
        model = model_of(gateways[0])
        decode = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json")).decode
        seeds = itertools.count(args.seed)
        for round_ in range(args.rounds):
            for index in range(len(args.paths)):
                path = args.paths[(round_ + index) % len(args.paths)]
                count = args.connections * (1 if path == "direct" else len(gateways))
                # the throughput workload's prompts as text (as bench/serve.py --text-prompts sends them)
                requests = make_requests(count, tuple(args.input_len), (args.output_tokens,) * 2, seed=next(seeds))
                bodies = [json.dumps({"model": model, "prompt": decode(r.prompt), "max_tokens": r.max_tokens,
                                      "stream": True, "ignore_eos": True}).encode() for r in requests]
                before = listen_overflows()
                streams = asyncio.run(burst(ports[path], bodies))
                overflows = listen_overflows() - before
                time.sleep(0.5)  # the last "request finished" lines reach the logs
                read_arrivals(logs, streams)
                runs.append({"path": path, "round": round_, **summarize(streams, overflows)})
                print_row(runs[-1])
                time.sleep(1.0)  # the connections' ends settle before the next burst
    return runs


def serve_router(args: argparse.Namespace) -> None:
    """SMG with up's flags and --policy, through --launcher, on --serve-router's port in front of
    --gateways, until stopped: another router for the same replicas, beside up's (gpu_scaleout.sh)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with router(args.gateways, args.policy, args.launcher == "own", args.out.with_suffix(".smg.log"),
                args.serve_router):
        print(f"SMG ({args.launcher} launcher, {args.policy}) routes on port {args.serve_router}", flush=True)
        signal.pause()


def print_row(r: dict) -> None:
    print(f"{r['path']:<9}{r['round']:>6}{r['connections']:>7}{r['slow_connects']:>6}{r['listen_overflows']:>10}"
          f"{r['arrival_ms']['p50']:>9.0f}{r['arrival_ms']['p90']:>9.0f}{r['arrival_ms']['p99']:>9.0f}"
          f"{r['arrival_spread_ms']:>9.0f}{r['first_token_ms']['p50']:>9.0f}{r['first_token_ms']['p90']:>9.0f}",
          flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("nanoserve", "echo"), default="nanoserve",
                   help="replicas started here: schedulers over a null worker with their gateways, or minimal HTTP "
                        "servers that answer at once (bench/router_overhead.py's: what SMG alone does to a burst)")
    p.add_argument("--replicas", type=int, default=1, help="replicas started here (direct goes to the first)")
    p.add_argument("--gateways", nargs="+", default=[], metavar="URL", help="running replicas' gateways instead")
    p.add_argument("--scheduler-logs", nargs="+", default=[], type=Path, metavar="FILE",
                   help="with --gateways: where their schedulers log (their \"request finished\" lines)")
    p.add_argument("--serve-router", type=int, default=0, metavar="PORT",
                   help="with --gateways: only run SMG (--launcher, --policy) on PORT in front of them until stopped")
    p.add_argument("--launcher", choices=("up", "own"), default="up",
                   help="for --serve-router: up's (its port's accept queue deepened) or SMG's own (128)")
    p.add_argument("--connections", type=int, default=512, help="connections a replica takes in each burst")
    p.add_argument("--paths", nargs="+", default=["direct", "smg", "smg-own"], choices=["direct", "smg", "smg-own"])
    p.add_argument("--policy", default="cache_aware", help="SMG's --policy")
    p.add_argument("--rounds", type=int, default=2, help="bursts a path, the paths' order rotating")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], help="prompt tokens, uniform in this range")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=5.0, help="the null worker's time a step")
    p.add_argument("--tokenizer", default=str(cache_dir() / "tokenizer-qwen3"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "burst_arrival.json")
    args = p.parse_args(argv)
    if (args.scheduler_logs or args.serve_router) and not args.gateways:
        p.error("--scheduler-logs and --serve-router go with --gateways")
    if args.gateways and not args.serve_router and not args.scheduler_logs:
        p.error("--gateways needs --scheduler-logs (the schedulers' arrival times)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.serve_router:
        serve_router(args)
        return
    print(f"{'path':<9}{'round':>6}{'conns':>7}{'slow':>6}{'overflows':>10}  arrival ms p50 / p90 / p99, "
          "spread; first token p50 / p90")
    with backends(args) as (gateways, logs):
        runs = run_paths(args, gateways, logs)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "replicas": len(gateways),
                                    "policy": args.policy, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
