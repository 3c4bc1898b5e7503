"""The tests' reserved ports: nobody else can take one, the server it is meant for still can."""
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from nanoserve.listen import ListenError, PortReservation, check_port_free
from tests.services.processes import ENV, free_ports

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ports are only held on Linux")


def test_a_reserved_port_is_refused_to_others_and_free_for_its_server():
    first, second = free_ports(2)
    assert second == first + 1
    with pytest.raises(OSError):
        PortReservation(port=first)  # a second reservation, or any bind without SO_REUSEADDR
    check_port_free("127.0.0.1", first, "the test's port")  # as every nanoserve server checks it
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        assert server.add_insecure_port(f"127.0.0.1:{first}") == first
        server.start()
        with pytest.raises(ListenError):  # listening now: the port is in use for anyone else
            check_port_free("127.0.0.1", first, "the test's port")
    finally:
        server.stop(0)


def test_a_port_another_test_process_reserved_is_refused_here():
    """`make test` runs pytest workers side by side (pytest-xdist): a worker's reservations are held in
    the kernel, so another worker (or anything else) can take none of them while they last."""
    hold = ("from tests.services.processes import free_ports\n"
            "print(*free_ports(3), flush=True)\n"
            "input()")  # held until told to go
    worker = subprocess.Popen([sys.executable, "-c", hold], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        held = [int(port) for port in worker.stdout.readline().split()]
        assert len(held) == 3
        for port in held:
            with pytest.raises(OSError):
                PortReservation(port=port)
    finally:
        worker.communicate("\n", timeout=30)
    PortReservation(port=held[0]).release()  # its worker let it go
