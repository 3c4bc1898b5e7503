"""Real replicas behind a real SMG router (`pip install smg`), every process on 127.0.0.1, started and
stopped here."""
import contextlib
import importlib.util
import subprocess
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

from nanoserve.flags import defaults
from nanoserve_cli.router import router_command, wait_routing
from tests.gateway.gateway_process import start_gateway, wait_listening
from tests.services.processes import ENV, free_port, shown_on_failure, start_scheduler, start_worker, stop, \
    wait_serving

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
def running_smg(worker_urls: list[str], log: Path, policy: str, *flags: str) -> Iterator[str]:
    """SMG as `nanoserve up --data-parallel-size N` runs it (nanoserve_cli/router.py), with `policy` and
    then `flags`, once it routes to every one of `worker_urls`; yields its URL."""
    port = free_port()
    up = Namespace(host="127.0.0.1", openai_port=port, router_policy=policy, shutdown_timeout=5,
                   max_num_seqs=defaults("up")["max_num_seqs"])
    proc = subprocess.Popen([*router_command(up, worker_urls, free_port()), *flags], env=ENV, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with shown_on_failure(log):
            wait_routing(url, len(worker_urls), lambda: proc.poll() is None, 60)
        yield url
    finally:
        stop([proc])
