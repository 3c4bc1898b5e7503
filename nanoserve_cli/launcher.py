"""`nanoserve up`: a scheduler and its worker ranks (and, with --openai-port, the OpenAI gateway)
as local processes, stopped together; with --data-parallel-size N, N such replicas behind the SMG
router (router.py) on --openai-port.

Each replica (replica.py) runs on ports and GPUs of its own (layout.py); its children get, in their
environment, a random --worker-token shared by this launcher's schedulers and workers. Busy ports,
too few GPUs and a checkpoint without its config.json or tokenizer.json fail before any child
starts; children die with the launcher (children.py). Ctrl-C or SIGTERM stops them front to back,
letting the requests in flight finish (stopping.py). Once serving, a worker rank that exits or hangs
is replaced with its whole group (supervision.py) while its scheduler holds its requests; when the
group keeps failing, or another child fails, `up` stops the others and exits 1 with that child's
last error line.
"""
import argparse
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from nanoserve.checkpoint import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, check_files
from nanoserve.healthcheck import SERVING, serving_status
from nanoserve.listen import ListenError, check_port_free
from nanoserve_cli import layout
from nanoserve_cli.cache import compile_caches, demo_model_dir
from nanoserve_cli.children import Child, describe, failure
from nanoserve_cli.replica import Replica
from nanoserve_cli.router import RouterMissing, router_command, wait_routing
from nanoserve_cli.stopping import StopSignals, stop_in_order, stop_tier
from nanoserve_cli.supervision import GaveUp


class LaunchError(Exception):
    """Why `up` cannot start, in one line."""


def demo_model() -> Path:
    """The built-in tiny demo model, built once into the cache."""
    target = demo_model_dir()
    if not (target / "model.safetensors").exists():
        print(f"building the tiny demo model (random weights) into {target} ...", flush=True)
        if subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model", str(target)]).returncode:
            raise LaunchError("building the demo model failed (the lines above say why)")
    return target


def check_before_start(args: argparse.Namespace, model: Path) -> None:
    """Raises LaunchError for a busy port or a local checkpoint missing a file the children need."""
    if args.data_parallel_size > 1 and not args.openai_port:
        raise LaunchError(f"--data-parallel-size {args.data_parallel_size} serves the replicas through the SMG "
                          "router on --openai-port: give one (e.g. --openai-port 8000)")
    try:
        for host, port, what in _ports(args):
            check_port_free(host, port, what)
        if model.exists():  # anything else is left to the worker (e.g. a Hub id)
            check_files(model, (CONFIG_FILE, TOKENIZER_FILE), "--model")
    except (ListenError, CheckpointError) as err:
        raise LaunchError(str(err)) from None


def _ports(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """Every port `up` takes: (host, port, the words naming it in an error)."""
    def offset(flag: str, base: int, port: int) -> str:
        return flag if port == base else f"{flag} + {port - base}"

    ports = []
    for d in range(args.data_parallel_size):
        whose = f"replica {d}'s " if args.data_parallel_size > 1 else ""
        ports.append((args.host, layout.scheduler_port(args, d),
                      f"{whose}the scheduler's {offset('--port', args.port, layout.scheduler_port(args, d))}"))
        ports += [("127.0.0.1", port, f"{whose}worker rank {rank}: --worker-base-port + {port - args.worker_base_port}")
                  for rank, port in enumerate(layout.worker_ports(args, d))]
        if args.metrics_port:
            ports.append((args.host, layout.metrics_port(args, d),
                          whose + offset("--metrics-port", args.metrics_port, layout.metrics_port(args, d))))
        if args.openai_port:
            port = layout.gateway_port(args, d)
            what = f"{whose}gateway: {offset('--openai-port', args.openai_port, port)}" if whose else "--openai-port"
            ports.append((layout.gateway_host(args), port, what))
    if args.data_parallel_size > 1:
        metrics = layout.router_metrics_port(args)
        ports += [(args.host, args.openai_port, "the router's --openai-port"),
                  (args.host, metrics, f"the router's metrics: {offset('--openai-port', args.openai_port, metrics)}")]
    return ports


def free_port() -> int:
    """A port free now, for a server bound at once (the benches); one bound later is held with a
    PortReservation until then, as the tests' free_port does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Blocks until the scheduler's health check says SERVING; fails fast if a process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(failure(dead[0]))
        try:
            if serving_status(address, timeout=1) == SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the scheduler at {address} was not serving after {timeout:.0f}s")


def wait_http_ok(url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Blocks until `url` answers 200 (the gateway's /health: up, its scheduler serving); fails fast if a
    process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dead := [p for p in procs if p.poll() is not None]:
            raise RuntimeError(f"{describe(dead[0])} exited with code {dead[0].returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:  # not listening yet, or 503 (an HTTPError) until its scheduler serves
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f}s")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stops processes that hold no requests (a test's, a bench's): SIGTERM, killed after 10 s."""
    stop_tier(procs, 10.0)


def run_local(args: argparse.Namespace) -> int:
    signals = StopSignals()
    try:
        # the GPUs first: a layout this host cannot hold is wrong whatever else runs on it (its ports)
        gpus = layout.replica_gpus(layout.visible_gpus(args.device, os.environ), args.data_parallel_size,
                                   args.tensor_parallel_size) if args.data_parallel_size > 1 else None
        model = Path(args.model) if args.model else demo_model()
        check_before_start(args, model)
        router = router_command(args, [f"http://127.0.0.1:{layout.gateway_port(args, d)}"
                                       for d in range(args.data_parallel_size)],
                                layout.router_metrics_port(args)) if args.data_parallel_size > 1 else None
    except (LaunchError, layout.TooFewGPUs, RouterMissing) as err:
        print(f"nanoserve up: {err}", file=sys.stderr)
        return 1
    # Only this launcher's schedulers can drive its workers.
    env = {**compile_caches(), **os.environ,
           "NANOSERVE_WORKER_TOKEN": os.environ.get("NANOSERVE_WORKER_TOKEN") or secrets.token_hex(16)}
    worker_exited = threading.Event()  # wakes the supervision loop at once
    replicas = [Replica(args, model, d, env, None if gpus is None else gpus[d], _say, worker_exited)
                for d in range(args.data_parallel_size)]
    for replica in replicas:
        replica.start()
    routers: list[subprocess.Popen] = []
    front = [proc for replica in replicas for proc in replica.front]
    try:
        outcome = _serve(args, model, replicas, front, routers, router, env, worker_exited)
    finally:
        for replica in replicas:
            replica.release()
        # The router first (it stops sending and lets what went through it finish), then the replicas'
        # schedulers and gateways (they drain), then their workers.
        stop_in_order([routers, [proc for replica in replicas for proc in replica.front],
                       [proc for replica in replicas for proc in replica.workers.procs + replica.workers.standbys]],
                       args.shutdown_timeout,
                      signals)
    if outcome:  # after the children's own last lines
        print(outcome, file=sys.stderr, flush=True)
    return 1 if outcome else 0


def _serve(args: argparse.Namespace, model: Path, replicas: list[Replica], front: list[subprocess.Popen],
           routers: list[subprocess.Popen], router: list[str] | None, env: dict[str, str],
           worker_exited: threading.Event) -> str:
    """Waits for the replicas (and the router) to serve, then keeps the worker groups running until
    a stop or a failure; returns "" for a stop, else the line that says what failed."""
    try:
        for replica in replicas:
            wait_serving(replica.address, replica.procs, args.worker_connect_timeout + 60)
            if args.openai_port:
                wait_http_ok(replica.gateway_url + "/health", replica.procs, 60)
        if router is not None:  # once the replicas serve: it takes them in at once
            routers.append(Child(router, env))
            front.append(routers[0])
            wait_routing(f"http://{args.host}:{args.openai_port}", len(replicas), lambda: routers[0].poll() is None,
                         60)
        print(_serving_line(args, model, replicas), flush=True)
        while all(p.poll() is None for p in front):
            worker_exited.clear()
            for replica in replicas:
                replica.workers.check()
            worker_exited.wait(0.5)
        dead = next(p for p in front if p.poll() is not None)
        return f"nanoserve up: {failure(dead)}; stopped the others"
    except (RuntimeError, GaveUp) as err:
        return f"nanoserve up failed: {err}"
    except KeyboardInterrupt:
        print(f"stopping nanoserve: requests in flight may finish within {args.shutdown_timeout:g}s "
              "(--shutdown-timeout); Ctrl-C again stops at once", flush=True)
        return ""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _serving_line(args: argparse.Namespace, model: Path, replicas: list[Replica]) -> str:
    """What `up` serves, where: one replica's gRPC address, or every replica's and the router's port."""
    ranks = f"{args.tensor_parallel_size} worker rank{'s' if args.tensor_parallel_size > 1 else ''}"
    url = f"http://{args.host}:{args.openai_port}/v1"
    if len(replicas) == 1:
        openai = f", the OpenAI API on {url}" if args.openai_port else ""
        return f"nanoserve is serving {model} on {replicas[0].address} ({ranks}{openai}); Ctrl-C stops it"
    where = "; ".join(f"replica {r.index} on {r.address}" + (f" (GPUs {','.join(r.gpus)})" if r.gpus else "")
                      for r in replicas)
    return (f"nanoserve is serving {model}: {len(replicas)} replicas of {ranks} each behind the SMG router "
            f"({args.router_policy}), the OpenAI API on {url}; gRPC: {where}; Ctrl-C stops it")
