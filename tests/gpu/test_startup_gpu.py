"""On a GPU machine, a configuration its GPUs cannot run stops at start with one line naming the flag,
run as a user runs `up`."""
import os
import subprocess

import pytest
import torch

from tests.services.processes import CLI, ENV, free_port, free_ports

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_two_ranks_on_one_gpu_stop_with_a_line_naming_the_flag(tiny_model_dir):
    """NCCL refuses two ranks on one GPU in several lines; the worker says what to change instead."""
    one_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = subprocess.run(CLI + ["up", "--model", str(tiny_model_dir), "--port", str(free_port()),
                                "--worker-base-port", str(free_ports(2)[0]), "--device", "cuda",
                                "--tensor-parallel-size", "2"],
                         env={**ENV, "CUDA_VISIBLE_DEVICES": one_gpu}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("nanoserve up failed: worker_svc --rank "), last
    assert " exited with code 1: " in last and " ERROR nanoserve.worker rank " in last, last
    assert ("cannot serve " in last and "the 2 ranks did not meet at " in last and "is another rank's too, and NCCL "
            f"needs a GPU for each rank: this process sees 1 GPU (CUDA_VISIBLE_DEVICES={one_gpu}); run at most 1 rank "
            "on this host (--tensor-parallel-size), or give each rank its own GPU") in last, last
