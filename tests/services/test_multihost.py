"""A tensor-parallel group spanning "hosts" on CPU (gloo): ranks with addresses of their own inside a
network namespace the test creates (multihost_group.py, under `unshare -n`: loopback only). Rank 1
SIGKILLed mid-stream, under either supervision policy, costs no request and no token; and a rank that
cannot reach rank 0's store says which address and port in one line."""
import re
import time

import pytest

from tests.services.multihost_group import NUM_REQUESTS, can_unshare, host, run
from tests.services.processes import free_port, shown_on_failure, start_worker, stop
from tests.services.test_recovery import MAX_TOKENS


@pytest.mark.skipif(not can_unshare(), reason="needs `unshare -n` (root, or user namespaces)")
@pytest.mark.parametrize("ranks, policy", [(2, "group"), (4, "alone")])
def test_rank_1_killed_mid_stream_on_its_own_host(tiny_model_dir, tmp_path, ranks, policy):
    log = tmp_path / "group.log"
    with shown_on_failure(log):
        result = run(tiny_model_dir, ranks, policy, log)
        assert result["got"] == result["expected"]  # every token once, in order: none lost, none sent twice
        assert result["received_at_kill"] < NUM_REQUESTS * MAX_TOKENS and result["running_after"] == 0
        # Each rank's sockets (gRPC, gloo) are on its own address; rank 0 also serves the store on all.
        assert host(0) in result["listening"][0]
        assert all(addresses == [host(rank)] for rank, addresses in enumerate(result["listening"][1:], start=1))
        text = log.read_text()
        assert "worker group back after" in text
        if policy == "alone":  # the survivors left on their own (a failed step or the heartbeat), each restarted alone
            assert text.count("restarting it alone") >= ranks
        else:
            assert "restarting the worker group" in text


def test_a_rank_that_cannot_reach_the_store_names_it_in_one_line(tiny_model_dir, tmp_path):
    log = tmp_path / "worker.log"
    store = f"127.0.0.9:{free_port()}"  # nothing listens there
    worker = start_worker(tiny_model_dir, free_port(), "--rank", "1", "--tensor-parallel-size", "2",
                          "--dist-init-addr", store, log=log)
    try:
        pattern = re.compile(rf"rank 1 cannot reach rank 0's store at {re.escape(store)} \(--dist-init-addr\): "
                             r".*Connection refused; still trying for \d+s$", re.M)
        deadline = time.monotonic() + 120
        while not pattern.search(log.read_text()) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pattern.search(log.read_text()), log.read_text()
    finally:
        stop([worker])
