"""The tests' reserved ports: nobody else can take one, the server it is meant for still can."""
import sys
from concurrent import futures

import grpc
import pytest

from nanoserve.listen import ListenError, PortReservation, check_port_free
from tests.services.processes import free_ports

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
