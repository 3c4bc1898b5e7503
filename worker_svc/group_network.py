"""Where the ranks of a tensor-parallel group meet and which addresses their sockets use, for a
group that spans hosts (DESIGN §11): rank 0's store at --dist-init-addr, each rank's gloo sockets
on its --advertise-host, and the interfaces torch documents for gloo and NCCL
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) from --dist-socket-ifname. A rank that cannot reach
the store says so in one line, naming the address and port, while it keeps trying."""
import logging
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from worker_svc.config import WorkerConfig

log = logging.getLogger("nanoserve.worker")

# Registered when --advertise-host is given: torch's own gloo binds what this host's name resolves
# to (or GLOO_SOCKET_IFNAME's interface), and neither can name one address of several on a host.
BOUND_GLOO = "gloo_advertised"
STORE_PROBE_SECONDS = 1.0
STORE_REMIND_SECONDS = 10.0


class StoreUnreachable(Exception):
    """The store did not answer in time; the message names its address and the last error."""


def use_socket_interfaces(config: WorkerConfig) -> None:
    """--dist-socket-ifname as the environment torch reads: gloo's and NCCL's interfaces."""
    if config.dist_socket_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = config.dist_socket_ifname


def gloo_backend(config: WorkerConfig) -> str:
    """The name of the gloo backend for this rank's groups: torch's, or one bound to --advertise-host."""
    host = config.advertise_host
    if not host:
        return "gloo"

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, options)

    # Registered for CUDA too, as torch's own gloo is: a group made while the default (NCCL) group is
    # bound to a GPU asks its backend for that device, and a CPU-only registration has none.
    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, create, devices=["cpu", "cuda"])
    return BOUND_GLOO


def wait_for_store(config: WorkerConfig, timeout: timedelta) -> None:
    """Returns once rank 0's store at --dist-init-addr accepts a connection (rank 0 hosts it and need
    not wait). Meanwhile one line every STORE_REMIND_SECONDS says what this rank cannot reach and why;
    StoreUnreachable past `timeout`."""
    if config.rank == 0:
        return
    host, _, port = config.dist_init_addr.rpartition(":")
    started = time.monotonic()
    reminded = -STORE_REMIND_SECONDS
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=STORE_PROBE_SECONDS).close()
            return
        except OSError as err:
            why = f"rank {config.rank} cannot reach rank 0's store at {host}:{port} (--dist-init-addr): {err}"
        waited = time.monotonic() - started
        if waited >= timeout.total_seconds():
            raise StoreUnreachable(f"{why}; gave up after {waited:.0f}s")
        if waited - reminded >= STORE_REMIND_SECONDS:
            log.warning("%s; still trying for %.0fs", why, timeout.total_seconds() - waited)
            reminded = waited
        time.sleep(STORE_PROBE_SECONDS)


def first_line(err: Exception) -> str:
    """torch.distributed's errors carry C++ frames after their first line; that line says what failed."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
