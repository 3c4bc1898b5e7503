"""One `nanoserve up`, run as a user runs it, through its life: the client commands against it, a
second `up` on the same ports that must fail fast without disturbing it, and a `kill -9` of the
launcher that must take its children with it. The tests run in this order and share the server."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from nanoserve.client import Client
from tests.services.processes import CLI, ENV, REPO, free_port, wait_serving

PROMPT = [(i * 7919) % 150000 for i in range(1, 20)]


@pytest.fixture(scope="module")
def up(tiny_model_dir, tmp_path_factory):
    port, worker_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    argv = CLI + ["up", "--model", str(tiny_model_dir), "--port", str(port), "--worker-base-port", str(worker_port),
                  "--device", "cpu", "--block-size", "16", "--num-kv-blocks", "64"]
    launcher = subprocess.Popen(argv, env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [launcher], log)
        yield {"launcher": launcher, "argv": argv, "address": address, "worker": f"127.0.0.1:{worker_port}", "log": log}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=30)


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(argv), env=ENV, capture_output=True, text=True, timeout=timeout)


def greedy(address: str) -> list[int]:
    with Client(address) as client:
        return client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True).token_ids


def test_info_stats_and_tokenize_print_json(up):
    info = json.loads(cli("info", "--address", up["address"]).stdout)
    assert (info["block_size"], info["num_kv_blocks"], info["max_model_len"]) == (16, 64, 64 * 16)
    assert (info["platform"], info["attention_backend"]) == (f"torch {torch.__version__}, CPU", "torch")
    greedy(up["address"])  # counters above 0
    with Client(up["address"]) as client:
        expected_stats = client.stats()
    stats = json.loads(cli("stats", "--address", up["address"]).stdout)
    assert stats["kv_blocks_total"] == 64 and stats["num_running"] == 0
    # every field as the message holds it: the uint64 counters as JSON numbers, not protobuf's strings
    assert stats == {field.name: getattr(expected_stats, field.name) for field in expected_stats.DESCRIPTOR.fields}
    assert stats["generated_tokens_total"] >= 12
    with Client(up["address"]) as client:
        expected = client.tokenize("Hello, world")
    assert json.loads(cli("tokenize", "Hello, world", "--address", up["address"]).stdout) == expected


def test_a_client_pointed_at_a_worker_is_told_so(up):
    out = cli("info", "--address", up["worker"])
    assert out.returncode == 1
    assert out.stderr.strip() == (f"error: {up['worker']} is a nanoserve worker (the internal Worker API), not the "
                                  "public API: point --address at the scheduler (port 50051 unless it was given "
                                  "another)")


def test_ctrl_c_ends_generate_in_one_line(up):
    # Ctrl-C as in a terminal: a shell's background job (`make test &`) starts with SIGINT ignored,
    # which the child would inherit, and Python then installs no KeyboardInterrupt for it.
    generate = subprocess.Popen(CLI + ["generate", "Hello", "--address", up["address"], "--max-tokens", "1000",
                                       "--ignore-eos"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    generate.stdout.read(1)  # streaming has begun
    generate.send_signal(signal.SIGINT)
    _, err = generate.communicate(timeout=30)
    assert generate.returncode == 130
    assert err.decode().strip() == "interrupted"


def test_a_second_up_on_the_same_ports_fails_fast_and_the_first_keeps_serving(up):
    before = greedy(up["address"])
    second = subprocess.run(up["argv"], env=ENV, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert f"cannot listen on {up['address']} (the scheduler's --port): the port is in use" in second.stderr
    assert "loading" not in second.stderr  # no child was started, no model loaded
    assert greedy(up["address"]) == before
    assert up["launcher"].poll() is None


def test_make_serve_stops_where_another_server_holds_the_port(up):
    port = up["address"].rsplit(":", 1)[1]
    # -o install: the environment is in place (make test installed it); serve's own recipe runs
    serve = subprocess.run(["make", "--no-print-directory", "-o", "install", "serve", f"PORT={port}"], cwd=REPO,
                           env=ENV, capture_output=True, text=True, timeout=120)
    assert serve.returncode != 0
    assert (f"make serve: a server already answers on {up['address']} (another nanoserve up?): stop it, or serve on "
            "another port: make serve PORT=50052") in serve.stderr
    assert serve.stdout == ""  # no request went to the other server
    assert up["launcher"].poll() is None


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that will never reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the launcher's children")
def test_children_die_with_a_killed_launcher(up):
    kids = children(up["launcher"].pid)
    assert len(kids) == 2, kids  # one worker and the scheduler
    os.kill(up["launcher"].pid, signal.SIGKILL)
    up["launcher"].wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(alive(kid) for kid in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(kid) for kid in kids), up["log"].read_text()[-3000:]
