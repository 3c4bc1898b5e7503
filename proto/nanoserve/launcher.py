"""`nanoserve up`: a scheduler and its worker ranks as local processes, stopped together."""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from nanoserve.cli import forward_flags
from nanoserve.healthcheck import SERVING, serving_status

_LAUNCHER_SET = {"model", "host", "port", "rank", "workers"}


def demo_model_dir() -> Path:
    """The built-in tiny demo model, built once into the cache."""
    cache = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))
    target = cache / "tiny-qwen3"
    if not (target / "model.safetensors").exists():
        print(f"building the tiny demo model into {target} ...", flush=True)
        subprocess.run([sys.executable, "-m", "model.tiny", str(target)], check=True)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Blocks until the scheduler's health check says SERVING; fails fast if a process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{' '.join(dead[0].args[2:5])} exited with code {dead[0].returncode}")
        try:
            if serving_status(address, timeout=1) == SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the scheduler at {address} was not serving after {timeout:.0f}s")


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
    model = Path(args.model) if args.model else demo_model_dir()
    size = args.tensor_parallel_size
    args.dist_init_addr = f"127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "nanoserve.cli"]
    worker_addrs = [f"127.0.0.1:{args.worker_base_port + r}" for r in range(size)]
    procs = [subprocess.Popen(cli + ["worker", "--model", str(model), "--host", "127.0.0.1",
                                     "--port", str(args.worker_base_port + r), "--rank", str(r)]
                              + forward_flags("worker", args, _LAUNCHER_SET))
             for r in range(size)]
    procs.append(subprocess.Popen(cli + ["scheduler", "--workers", ",".join(worker_addrs),
                                         "--host", args.host, "--port", str(args.port)]
                                  + forward_flags("scheduler", args, _LAUNCHER_SET)))
    signal.signal(signal.SIGTERM, _interrupt)
    address = f"{args.host}:{args.port}"
    try:
        wait_serving(address, procs, args.worker_connect_timeout + 60)
        print(f"nanoserve is serving {model} on {address} "
              f"({size} worker rank{'s' if size > 1 else ''}); Ctrl-C stops it", flush=True)
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
