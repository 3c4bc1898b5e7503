"""A server's port, taken exclusively, or one line saying why it cannot be."""
import errno
import socket
import sys

import grpc

_REASONS = {errno.EADDRINUSE: "the port is in use (by another nanoserve, or another program)",
            errno.EADDRNOTAVAIL: "this machine has no such address",
            errno.EACCES: "permission denied"}


class ListenError(Exception):
    """The one line a person reads when a server cannot take its port."""


def check_port_free(host: str, port: int, what: str) -> None:
    """Raises ListenError when `host:port` cannot be bound now, e.g. another server listens there.
    Checked before anything slow (loading a model, meeting other ranks) so a busy port fails fast."""
    host = host.strip("[]")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ListenError(f"cannot listen on {host}:{port} ({what}): {err.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc: TIME_WAIT is free
            try:
                probe.bind(address)
            except OSError as err:
                reason = _REASONS.get(err.errno, err.strerror)
                raise ListenError(f"cannot listen on {host}:{port} ({what}): {reason}") from None


class PortReservation:
    """A free port of `host` (`port` 0: any), held until released so that only the server it is meant
    for can take it. Picked and closed at once, a port was anyone's until that server bound it, often
    seconds later (a worker imports torch first): meanwhile another process's bind to port 0, or an
    outgoing connection's local port, could take it and the server failed with "in use". Held, the
    kernel hands it to neither, yet the server's bind still succeeds: the holder is bound without
    SO_REUSEADDR (so it fails where anything holds the port already) and sets it afterwards, and
    Linux lets two SO_REUSEADDR sockets share a port while neither listens. check_port_free, gRPC,
    uvicorn and torch's TCPStore all bind with SO_REUSEADDR. Elsewhere sharing needs SO_REUSEPORT
    too, so off Linux the port is only found, not held."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._socket = socket.socket()
        try:
            self._socket.bind((host, port))
        except (OSError, OverflowError):
            self._socket.close()
            raise
        self.port: int = self._socket.getsockname()[1]
        if sys.platform == "linux":
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        else:
            self.release()

    def release(self) -> None:
        """Lets the port go (a server that bound it keeps it)."""
        self._socket.close()


def listen(server: grpc.Server | grpc.aio.Server, host: str, port: int, what: str,
           credentials: grpc.ServerCredentials | None = None) -> str:
    """Adds host:port to the server (TLS with `credentials`); returns the address. Raises ListenError."""
    check_port_free(host, port, what)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 host goes in brackets
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # taken between the check and here
        bound = 0
    if not bound:
        raise ListenError(f"cannot listen on {address} ({what}): {_REASONS[errno.EADDRINUSE]}")
    return address
