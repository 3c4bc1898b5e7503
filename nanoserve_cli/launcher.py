"""`nanoserve up`: a scheduler and its worker ranks (and, with --openai-port, the OpenAI gateway)
as local processes, stopped together.

Each child is the service itself (`python -m worker_svc`, `python -m scheduler_svc`,
`python -m gateway_svc`), never imported here. It gets the flags `up` shares with its command in the
flag table, as `up` parsed them, plus the ones only the launcher can know (ports, ranks, addresses)
and, in its environment, a random --worker-token shared by this launcher's scheduler and workers.
Busy ports and a checkpoint without its config.json or tokenizer.json fail before any child starts;
children die with the launcher (children.py). Ctrl-C or SIGTERM stops them front to back, letting
the requests in flight finish (stopping.py). Once serving, a worker rank that exits or hangs is
replaced with its whole group (supervision.py) while the scheduler holds its requests; when the
group keeps failing, or another child fails, `up` stops the others and exits 1 with that child's
last error line.
"""
import argparse
import itertools
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from nanoserve import flags
from nanoserve.checkpoint import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, check_files
from nanoserve.healthcheck import SERVING, serving_status
from nanoserve.listen import ListenError, PortReservation, check_port_free
from nanoserve_cli.cache import demo_model_dir
from nanoserve_cli.children import Child
from nanoserve_cli.stopping import StopSignals, stop_in_order, stop_tier
from nanoserve_cli.supervision import GaveUp, WorkerGroupSupervisor

SERVICE_MODULES = {"worker": "worker_svc", "scheduler": "scheduler_svc", "gateway": "gateway_svc"}  # command -> module


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
    ports = [(args.host, args.port, "the scheduler's --port")]
    ports += [("127.0.0.1", args.worker_base_port + rank, f"worker rank {rank}: --worker-base-port + {rank}")
              for rank in range(args.tensor_parallel_size)]
    if args.metrics_port:
        ports.append((args.host, args.metrics_port, "--metrics-port"))
    if args.openai_port:
        ports.append((args.host, args.openai_port, "--openai-port"))
    try:
        for host, port, what in ports:
            check_port_free(host, port, what)
        if model.exists():  # anything else is left to the worker (e.g. a Hub id)
            check_files(model, (CONFIG_FILE, TOKENIZER_FILE), "--model")
    except (ListenError, CheckpointError) as err:
        raise LaunchError(str(err)) from None


def free_port() -> int:
    """A port free now, for a server bound at once (the benches); one bound later is held with a
    PortReservation until then, as the tests' free_port does."""
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


def failure(proc: subprocess.Popen) -> str:
    """How a child ended, e.g. `worker_svc --rank 0 exited with code 1: <its last error line>`."""
    why = proc.failure() if isinstance(proc, Child) else f"exited with code {proc.returncode}"
    return f"{describe(proc)} {why}"


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
        model = Path(args.model) if args.model else demo_model()
        check_before_start(args, model)
    except LaunchError as err:
        print(f"nanoserve up: {err}", file=sys.stderr)
        return 1
    size = args.tensor_parallel_size
    # Only this launcher's scheduler can drive its workers.
    env = {**os.environ, "NANOSERVE_WORKER_TOKEN": os.environ.get("NANOSERVE_WORKER_TOKEN") or secrets.token_hex(16)}

    # Held until the group it was picked for is replaced: rank 0 binds it only once torch is imported.
    meeting: list[PortReservation] = []

    def start_workers() -> list[subprocess.Popen]:
        for held in meeting:
            held.release()
        meeting[:] = [PortReservation()]  # a fresh meeting point: the last group's may linger
        dist_init_addr = f"127.0.0.1:{meeting[0].port}"
        return [Child(worker_command(args, model, rank, dist_init_addr), env) for rank in range(size)]

    workers = WorkerGroupSupervisor(start_workers, [f"127.0.0.1:{args.worker_base_port + r}" for r in range(size)],
                                    describe, failure, args.max_worker_restarts, args.step_timeout,
                                    lambda line: print(line, file=sys.stderr, flush=True))
    workers.start()
    others = [Child(scheduler_command(args), env)]
    if args.openai_port:  # started now: it waits for the scheduler itself, and says so
        others.append(Child(gateway_command(args), env))
    address = f"{args.host}:{args.port}"
    try:
        wait_serving(address, workers.procs + others, args.worker_connect_timeout + 60)
        openai = ""
        if args.openai_port:
            url = f"http://{args.host}:{args.openai_port}"
            wait_http_ok(url + "/health", workers.procs + others, 60)
            openai = f", the OpenAI API on {url}/v1"
        print(f"nanoserve is serving {model} on {address} ({size} worker rank{'s' if size > 1 else ''}{openai}); "
              "Ctrl-C stops it", flush=True)
        while all(p.poll() is None for p in others):
            workers.check()
            time.sleep(0.5)
        dead = next(p for p in others if p.poll() is not None)
        print(f"nanoserve up: {failure(dead)}; stopping the others", file=sys.stderr)
        return 1
    except (RuntimeError, GaveUp) as err:
        print(f"nanoserve up failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"stopping nanoserve: requests in flight may finish within {args.shutdown_timeout:g}s "
              "(--shutdown-timeout); Ctrl-C again stops at once", flush=True)
        return 0
    finally:
        workers.liveness.stop()
        stop_in_order([others, workers.procs], args.shutdown_timeout, signals)
        for held in meeting:
            held.release()
