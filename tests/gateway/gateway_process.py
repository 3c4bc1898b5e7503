"""Starts the gateway as users start it, `python -m gateway_svc`, beside real scheduler processes."""
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from tests.services.processes import ENV, free_port, stop


def start_gateway(scheduler: str, port: int, *flags: str, log: Path, env: dict[str, str] = ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway_svc", "--scheduler", scheduler, "--host", "127.0.0.1",
                             "--port", str(port), *flags], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def wait_listening(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    """Until the gateway answers HTTP at all (any status: its scheduler may be down on purpose)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            httpx.get(url + "/health", timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"the gateway did not answer within {timeout}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def running_gateway(scheduler: str, log: Path, *flags: str) -> Iterator[str]:
    """A gateway process in front of `scheduler`; yields its base URL."""
    port = free_port()
    proc = start_gateway(scheduler, port, *flags, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(url, proc, log)
        yield url
    finally:
        stop([proc])
