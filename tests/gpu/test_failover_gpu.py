"""Two tensor-parallel ranks with NCCL on two GPUs, each with an address of its own (127.0.0.2 and
.3, NCCL and gloo on loopback through --dist-socket-ifname), rank 1 SIGKILLed mid-stream and each
rank restarted alone (tests/services/multihost_group.py): every greedy and seeded stream ends with
the tokens of an undisturbed run. Prints how long the scheduler waited for the group to come back.

Needs two GPUs (the lent nvidia-h100-x2), from the repo root (bench/gpu_failover.sh runs it):
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_failover_gpu.py -q -s
"""
import json
import os
from pathlib import Path

import pytest
import torch

from tests.services.multihost_group import can_unshare, run
from tests.services.processes import ENV, shown_on_failure

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_rank_1_killed_mid_stream_loses_no_token_on_two_gpus(tiny_model_dir, tmp_path):
    log = tmp_path / "group.log"
    # Its own network namespace where it may make one (root); else the host's, where 127.0.0.0/8 is loopback too.
    isolated = can_unshare()
    with shown_on_failure(log):
        result = run(tiny_model_dir, 2, "alone", log, "--dist-socket-ifname", "lo", isolated=isolated,
                     env={**ENV, "NANOSERVE_TEST_DEVICE": "cuda"}, timeout=200)
        assert result["got"] == result["expected"]
    summary = {key: result[key] for key in ("group_back_after_seconds", "seconds_to_the_end", "restarts",
                                            "received_at_kill")}
    print("failover:", json.dumps({**summary, "own_namespace": bool(isolated)}))
    if os.environ.get("OUT"):  # bench/gpu_failover.sh keeps the whole result
        Path(os.environ["OUT"], "gpu_failover.json").write_text(json.dumps(result))
