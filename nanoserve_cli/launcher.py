"""`nanoserve up`: a scheduler and its worker ranks (and, with --openai-port, the OpenAI gateway)
as local processes, stopped together.

Each child is the service itself (`python -m worker_svc`, `python -m scheduler_svc`,
`python -m gateway_svc`), never imported here. It gets the flags `up` shares with its command in the
flag table, as `up` parsed them, plus the ones only the launcher can know (ports, ranks, addresses).
"""
import argparse
import itertools
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from nanoserve import flags
from nanoserve.healthcheck import SERVING, serving_status
from nanoserve_cli.cache import demo_model_dir

SERVICE_MODULES = {"worker": "worker_svc", "scheduler": "scheduler_svc", "gateway": "gateway_svc"}  # command -> module


def demo_model() -> Path:
    """The built-in tiny demo model, built once into the cache."""
    target = demo_model_dir()
    if not (target / "model.safetensors").exists():
        print(f"building the tiny demo model into {target} ...", flush=True)
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model", str(target)], check=True)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_command(command: str, args: argparse.Namespace, **given) -> list[str]:
    """`command`'s service with the flags `up` shares with it, as `up` parsed them, and `given`."""
    shared = {flag.dest: getattr(args, flag.dest) for flag in flags.shared("up", command)}
    return [sys.executable, "-m", SERVICE_MODULES[command], *flags.to_argv(command, shared | given)]


def worker_command(args: argparse.Namespace, model: Path, rank: int, dist_init_addr: str) -> list[str]:
    return service_command("worker", args, model=model, host="127.0.0.1",
                           port=args.worker_base_port + rank, rank=rank, dist_init_addr=dist_init_addr)


def scheduler_command(args: argparse.Namespace) -> list[str]:
    workers = [f"127.0.0.1:{args.worker_base_port + r}" for r in range(args.tensor_parallel_size)]
    return service_command("scheduler", args, host=args.host, workers=",".join(workers))


def gateway_command(args: argparse.Namespace) -> list[str]:
    return service_command("gateway", args, scheduler=f"{args.host}:{args.port}", host=args.host,
                           port=args.openai_port)


def describe(proc: subprocess.Popen) -> str:
    """A child as a person tells it apart: "worker_svc --rank 1", "nanoserve_cli scheduler"."""
    words = [str(word) for word in proc.args[2:]]
    name = list(itertools.takewhile(lambda word: not word.startswith("-"), words))
    rank = words[words.index("--rank"):][:2] if "--rank" in words else []
    return " ".join(name + rank)


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Blocks until the scheduler's health check says SERVING; fails fast if a process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{describe(dead[0])} exited with code {dead[0].returncode}")
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
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the group the same way Ctrl-C does


def run_local(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else demo_model()
    size = args.tensor_parallel_size
    dist_init_addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(worker_command(args, model, rank, dist_init_addr)) for rank in range(size)]
    procs.append(subprocess.Popen(scheduler_command(args)))
    if args.openai_port:  # started now: it waits for the scheduler itself, and says so
        procs.append(subprocess.Popen(gateway_command(args)))
    signal.signal(signal.SIGTERM, _interrupt)
    address = f"{args.host}:{args.port}"
    try:
        wait_serving(address, procs, args.worker_connect_timeout + 60)
        openai = ""
        if args.openai_port:
            url = f"http://{args.host}:{args.openai_port}"
            wait_http_ok(url + "/health", procs, 60)
            openai = f", the OpenAI API on {url}/v1"
        print(f"nanoserve is serving {model} on {address} ({size} worker rank{'s' if size > 1 else ''}{openai}); "
              "Ctrl-C stops it", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a nanoserve process exited; stopping the others", file=sys.stderr)
        return 1
    except RuntimeError as err:
        print(f"nanoserve up failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping nanoserve ...", flush=True)
        return 0
    finally:
        stop_all(procs)
