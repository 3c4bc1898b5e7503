"""Real replicas behind a real SMG router (`pip install smg`), every process on 127.0.0.1, started and
stopped here."""
import contextlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.gateway.gateway_process import start_gateway, wait_listening
from tests.services.processes import ENV, free_port, shown_on_failure, start_scheduler, start_worker, stop, \
    wait_serving

SMG = [sys.executable, "-m", "smg", "launch"]
SMG_INSTALLED = importlib.util.find_spec("smg") is not None


@contextlib.contextmanager
def running_replicas(model_dir: Path, log: Path, worker_flags: tuple[str, ...], gateway_flags: tuple[str, ...],
                     scheduler_flags: list[tuple[str, ...]]) -> Iterator[list[dict]]:
    """A replica (a worker, a scheduler and a gateway) per entry of `scheduler_flags`, started side by
    side; yields [{'url', 'address', 'worker', 'worker_port', 'procs'}] in order. A test that replaces a
    worker puts the new one in its place in 'procs' (every replica's processes, stopped at the end)."""
    replicas, procs = [], []
    try:
        for flags in scheduler_flags:
            worker_port, address, http_port = free_port(), f"127.0.0.1:{free_port()}", free_port()
            procs += [start_worker(model_dir, worker_port, *worker_flags, log=log),
                      start_scheduler([f"127.0.0.1:{worker_port}"], int(address.split(":")[1]), *flags, log=log),
                      start_gateway(address, http_port, *gateway_flags, log=log)]
            replicas.append({"address": address, "url": f"http://127.0.0.1:{http_port}", "worker": procs[-3],
                             "worker_port": worker_port, "procs": procs})
        for replica in replicas:
            wait_serving(replica["address"], procs, log)
            wait_listening(replica["url"], procs[-1], log)
        yield replicas
    finally:
        stop(procs)


@contextlib.contextmanager
def running_smg(worker_urls: list[str], log: Path, *flags: str) -> Iterator[str]:
    """An SMG router in front of `worker_urls`, once it has registered every one of them; yields its URL."""
    port = free_port()
    argv = [*SMG, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn", *flags]
    proc = subprocess.Popen(argv, env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with shown_on_failure(log):
            wait_registered(url, proc, set(worker_urls))
        yield url
    finally:
        stop([proc])


def wait_registered(url: str, proc: subprocess.Popen, worker_urls: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"smg exited with code {proc.returncode}"
        with contextlib.suppress(httpx.TransportError, ValueError):
            workers = httpx.get(url + "/workers", timeout=5).json().get("workers", [])
            if {w["url"] for w in workers if w.get("is_healthy", w.get("healthy"))} >= worker_urls:
                return
        assert time.monotonic() < deadline, f"smg did not register {sorted(worker_urls)} within {timeout}s"
        time.sleep(0.3)
