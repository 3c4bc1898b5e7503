"""SMG's router as `up` runs it: `python -m nanoserve_cli.smg_router SMG-FLAGS...` is SMG's own launcher
(smg.launch_router, the same flags and behaviour) with one thing more, a deeper accept queue on its port.

SMG listens with the accept queue Rust's standard library gives every listener, 128 connections, and
no flag changes it. A burst of new connections larger than what SMG accepts meanwhile overflows it: the
kernel drops those SYNs and each client sends its SYN again only after its initial retransmission
timeout, one second (three for a second drop). On the 2-core development machine 512 connections
opened at once to a freshly started SMG lost 125-156 SYNs so (bench/burst_arrival.py); a benchmark
that opens its 512 streams at once from four client processes can do the same; on two H200s its
requests reached the replicas spread over about a second (docs/scale-out.md). uvicorn, each replica's
gateway, listens with 2,048. Linux sets a listening socket's queue again on another listen() on it, so
a thread here finds SMG's listening socket among this process's descriptors once SMG has bound it, and
deepens its queue.
"""
import logging
import os
import socket
import struct
import sys
import threading
import time

from smg.launch_router import launch_router, parse_router_args

ACCEPT_QUEUE = 4096  # as deep as Linux allows by default (net.core.somaxconn caps it)
FIND_SECONDS = 60.0  # SMG binds its port within a second of starting; a slower start is still found

log = logging.getLogger("nanoserve.router")


def accept_queue(sock: socket.socket) -> int:
    """A listening TCP socket's accept-queue bound (Linux's tcp_info reports it as tcpi_sacked)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("=8x6I", info)[5]  # 8 one-byte fields, then rto, ato, ..., unacked, sacked


def listener_on(port: int) -> socket.socket | None:
    """This process's listening TCP socket on `port` (a duplicate descriptor: closing it leaves SMG's open)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            fd = os.dup(int(name))
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed and reused for something else meanwhile
            os.close(fd)
            continue
        if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.getsockname()[1] == port):
            return sock
        sock.close()
    return None


def deepen_accept_queue(port: int, depth: int = ACCEPT_QUEUE, timeout: float = FIND_SECONDS) -> None:
    """Waits for SMG's listening socket on `port` and sets its accept queue to `depth` (never shallower)."""
    deadline = time.monotonic() + timeout
    while (sock := listener_on(port)) is None:
        if time.monotonic() > deadline:
            log.warning("SMG's listening socket on port %d was not found within %.0fs: its accept queue stays at "
                        "SMG's own depth", port, timeout)
            return
        time.sleep(0.01)
    with sock:
        before = accept_queue(sock)
        if before < depth:
            sock.listen(depth)
        log.info("SMG's accept queue on port %d holds %d connections (SMG listens with %d)", port,
                 accept_queue(sock), before)


def main(argv: list[str]) -> None:
    args = parse_router_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    threading.Thread(target=deepen_accept_queue, args=(args.port,), name="accept-queue", daemon=True).start()
    launch_router(args)  # blocks until SMG stops; it releases the GIL meanwhile


if __name__ == "__main__":
    main(sys.argv[1:])
