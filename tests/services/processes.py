"""Starts real nanoserve processes on free loopback ports, the way users start them."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from nanoserve.healthcheck import serving_status
from nanoserve.listen import PortReservation
from nanoserve_cli.launcher import stop_all as stop  # noqa: F401 (re-exported for the tests)
from nanoserve_cli.launcher import wait_serving as launcher_wait_serving

REPO = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("NANOSERVE_TEST_DEVICE", "cpu")  # cuda runs the same suite on a GPU
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                 os.environ.get("PYTHONPATH")])),
       "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "nanoserve_cli"]


_reserved: list[PortReservation] = []  # released after each test (tests/conftest.py)


def free_ports(count: int) -> list[int]:
    """`count` consecutive loopback ports (a --worker-base-port and its ranks' after it), held until
    the test ends: a test picks its ports first and its processes bind them seconds later (a rank
    may start a minute later), and a port picked then closed was meanwhile anyone's (PortReservation)."""
    while True:
        run = [PortReservation()]
        try:
            run += [PortReservation(port=run[0].port + i) for i in range(1, count)]
        except (OSError, OverflowError):  # one after it is taken (or past 65535): another run
            for held in run:
                held.release()
            continue
        _reserved.extend(run)
        return [held.port for held in run]


def free_port() -> int:
    return free_ports(1)[0]


def release_ports() -> None:
    """Lets the test's ports go; its servers, bound by now, keep theirs."""
    for held in _reserved:
        held.release()
    _reserved.clear()


def start_worker(model_dir: Path, port: int, *flags: str, log: Path) -> subprocess.Popen:
    if DEVICE == "cuda" and "--tensor-parallel-size" in flags:
        _skip_unless_gpus(int(flags[flags.index("--tensor-parallel-size") + 1]))
    return subprocess.Popen(CLI + ["worker", "--model", str(model_dir), "--host", "127.0.0.1",
                                   "--port", str(port), "--device", DEVICE, *flags],
                            env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _skip_unless_gpus(ranks: int) -> None:
    """On CUDA each rank needs a GPU of its own (NCCL refuses two ranks on one)."""
    import torch  # only where the suite runs on a GPU

    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks on CUDA need {ranks} GPUs; this machine shows {torch.cuda.device_count()}")


def start_scheduler(workers: list[str], port: int, *flags: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["scheduler", "--workers", ",".join(workers), "--host", "127.0.0.1",
                                   "--port", str(port), *flags],
                            env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def health_status(address: str) -> str | None:
    """The server's grpc.health.v1 status name ("SERVING", "NOT_SERVING"), or None when it does not answer."""
    try:
        return serving_status(address, timeout=1)
    except grpc.RpcError:
        return None


def wait_serving(address: str, procs: list[subprocess.Popen], log: Path, timeout: float = 120) -> None:
    """The launcher's wait, with the processes' log in the error."""
    try:
        launcher_wait_serving(address, procs, timeout)
    except RuntimeError as err:
        raise RuntimeError(f"{err}:\n{log.read_text()[-4000:]}") from None


def children(parent: int, module: str) -> list[tuple[list[bytes], int]]:
    """(argv, pid) of `parent`'s live child processes that run `module` (a launcher's services), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == parent and module.encode() in argv:
            found.append((argv, int(stat.parent.name)))
    return found


def wait_answering(address: str, timeout: float = 20) -> str | None:
    """The health status once the server answers at all (None if it never does)."""
    deadline = time.monotonic() + timeout
    while (status := health_status(address)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return status


@contextlib.contextmanager
def shown_on_failure(*logs: Path) -> Iterator[None]:
    """Prints the processes' logs when the block fails: pytest shows a failed test's output, so a CI
    failure carries what the processes said (a test's temporary folder is gone by then)."""
    try:
        yield
    except BaseException:
        for log in logs:
            print(f"--- {log.name} ---\n{log.read_text(errors='replace') if log.exists() else '(no log)'}")
        raise


@contextlib.contextmanager
def running_service(model_dir: Path, log: Path, tensor_parallel_size: int = 1,
                    worker_flags: tuple[str, ...] = (), scheduler_flags: tuple[str, ...] = ()) -> Iterator[dict]:
    """Worker rank(s) and a scheduler; yields {'address', 'procs', 'workers'}."""
    dist = f"127.0.0.1:{free_port()}"
    ports = free_ports(tensor_parallel_size)
    workers = [start_worker(model_dir, port, "--rank", str(rank), "--tensor-parallel-size",
                            str(tensor_parallel_size), "--dist-init-addr", dist, *worker_flags, log=log)
               for rank, port in enumerate(ports)]
    address = f"127.0.0.1:{free_port()}"
    scheduler = start_scheduler([f"127.0.0.1:{p}" for p in ports], int(address.split(":")[1]),
                                *scheduler_flags, log=log)
    procs = [*workers, scheduler]
    try:
        wait_serving(address, procs, log)
        yield {"address": address, "procs": procs, "workers": workers, "scheduler": scheduler}
    finally:
        stop(procs)


def wait_idle(client, timeout: float = 20):
    """The scheduler's stats once it holds no request and no KV block (a client's earlier requests may
    still be ending); AssertionError past `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the scheduler still holds requests: {stats}")
