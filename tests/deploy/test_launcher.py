"""`nanoserve up` and `nanoserve generate` as a user runs them: start, answer, stop cleanly."""
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.services.processes import CLI, ENV, REPO, free_port, free_ports, health_status, wait_serving


@pytest.mark.parametrize("ranks", [1, 2])
def test_up_serves_generate_streams_and_sigterm_stops_everything(tiny_model_dir, tmp_path: Path, ranks: int):
    port, worker_port = free_port(), free_ports(ranks)[0]  # ranks listen on worker_port + rank
    log = tmp_path / "up.log"
    up = subprocess.Popen(CLI + ["up", "--model", str(tiny_model_dir), "--port", str(port), "--worker-base-port",
                                 str(worker_port), "--tensor-parallel-size", str(ranks), "--device", "cpu",
                                 "--block-size", "16"],
                          env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [up], log)
        announced = f"serving {tiny_model_dir} on {address} ({ranks} worker rank"
        deadline = time.monotonic() + 10  # `up` polls the same health check a moment later
        while announced not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert announced in log.read_text()
        out = subprocess.run(CLI + ["generate", "Hello there", "--address", address, "--max-tokens", "6"],
                             env=ENV, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()
        assert "FINISH_REASON_LENGTH" in out.stderr and "6 generated" in out.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    assert health_status(address) is None
    assert all(health_status(f"127.0.0.1:{worker_port + r}") is None for r in range(ranks))  # workers too


def test_generate_reports_an_unreachable_server(tmp_path: Path):
    out = subprocess.run(CLI + ["generate", "hi", "--address", f"127.0.0.1:{free_port()}"], env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr


def test_make_and_up_share_one_model_cache(tiny_model_dir, tmp_path: Path):
    """`make tiny-model` (and so `make test`) builds the demo model where `nanoserve up` looks for it: with
    no $NANOSERVE_CACHE, ~/.cache/nanoserve; up then serves it without building another."""
    cache = tmp_path / ".cache" / "nanoserve"
    tokenizer = tiny_model_dir.parent / "tokenizer-qwen3"  # copied: the build fetches it with npm otherwise
    shutil.copytree(tokenizer, cache / "tokenizer-qwen3")
    env = {name: value for name, value in ENV.items() if name != "NANOSERVE_CACHE"} | {"HOME": str(tmp_path)}
    built = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "tiny-model"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip().splitlines()[-1] == str(cache / "tiny-qwen3")
    assert (cache / "tiny-qwen3" / "model.safetensors").exists()
    with socket.create_server(("127.0.0.1", 0)) as busy:  # up stops at its port check, after finding the model
        port = busy.getsockname()[1]
        up = subprocess.run(CLI + ["up", "--port", str(port)], env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 1
    assert "building" not in up.stdout + up.stderr
    assert f"cannot listen on 127.0.0.1:{port} (the scheduler's --port): the port is in use" in up.stderr
