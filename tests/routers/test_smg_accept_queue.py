"""SMG's port as `nanoserve up` runs it takes a burst of new connections: its accept queue is as deep as
the host allows (nanoserve_cli/smg_router.py), where SMG's own launcher listens with 128 and a larger
burst waits a SYN retransmission (bench/burst_arrival.py). The queue's bound is read with iproute2's
`ss`, which asks the kernel (inet_diag), not with the code under test."""
import argparse
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from nanoserve.flags import defaults
from nanoserve_cli.router import router_command
from nanoserve_cli.smg_router import ACCEPT_QUEUE, accept_queue
from tests.routers.smg_process import SMG_INSTALLED
from tests.services.processes import ENV, free_port, shown_on_failure, stop

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2's ss is not installed")


def queue_bound(port: int) -> int:
    """The accept-queue bound of the socket listening on 127.0.0.1:port, as `ss -ltn` shows it (Send-Q)."""
    rows = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(rows.split()[2])


def test_accept_queue_reads_the_bound_ss_shows():
    with socket.create_server(("127.0.0.1", 0), backlog=77) as sock:
        assert accept_queue(sock) == queue_bound(sock.getsockname()[1]) == 77


@pytest.mark.skipif(not SMG_INSTALLED, reason="SMG is not installed (pip install smg, requirements-dev.txt)")
def test_router_port_queues_what_the_host_allows(tmp_path: Path):
    port, log = free_port(), tmp_path / "smg.log"
    up = argparse.Namespace(host="127.0.0.1", openai_port=port, router_policy="cache_aware", shutdown_timeout=5,
                            max_num_seqs=defaults("up")["max_num_seqs"])
    # no replica needs to answer: SMG listens at once and keeps probing them
    with log.open("ab") as output:
        proc = subprocess.Popen(router_command(up, [f"http://127.0.0.1:{free_port()}"], free_port()), env=ENV,
                                stdout=output, stderr=subprocess.STDOUT)
    try:
        with shown_on_failure(log):
            deadline = time.monotonic() + 60
            while "accept queue" not in log.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, "the router never said its accept queue"
                time.sleep(0.1)
            somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
            assert queue_bound(port) == min(ACCEPT_QUEUE, somaxconn)  # SMG's own launcher: 128
    finally:
        stop([proc])
