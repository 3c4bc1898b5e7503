"""--api-server-count: several gateway processes on one port answer the openai client, /metrics (from
whichever answers) adds up all of theirs, a busy port fails before any starts, and SIGTERM stops them all."""
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from prometheus_client.multiprocess import MultiProcessCollector

from tests.gateway.gateway_process import start_gateway, wait_listening
from tests.gateway.test_metrics import delta, scrape
from tests.services.processes import ENV, free_port

COMPLETIONS_OK = {"method": "POST", "path": "/v1/completions", "status": "200"}


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def served_by_process(folder: Path) -> dict[int, float]:
    """pid -> the completions it answered with 200, from its own metrics file."""
    served = {}
    for path in folder.glob("counter_*.db"):
        samples = [s for m in MultiProcessCollector.merge([str(path)], accumulate=False) for s in m.samples
                   if s.name == "nanoserve_gateway_http_requests_total" and s.labels == COMPLETIONS_OK]
        served[int(path.stem.split("_")[1])] = sum(s.value for s in samples)
    return served


def test_processes_share_the_port_metrics_add_up_and_sigterm_stops_them_all(service, model_name, tmp_path):
    folder, log, port = tmp_path / "metrics", tmp_path / "gateway.log", free_port()
    folder.mkdir()
    gateway = start_gateway(service["address"], port, "--api-server-count", "2", log=log,
                            env={**ENV, "PROMETHEUS_MULTIPROC_DIR": str(folder)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(url, gateway, log)
        deadline = time.monotonic() + 60
        while len(ready := {line for line in log.read_text().splitlines() if "the OpenAI API is ready" in line}) < 2:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        processes = descendants(gateway.pid)
        before, sent = scrape(url + "/metrics"), 0
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as oai, \
                ThreadPoolExecutor(8) as pool:
            def complete(i: int) -> str:
                chunks = oai.completions.create(model=model_name, prompt=f"count {i}", max_tokens=8, stream=True,
                                                extra_body={"ignore_eos": True})
                return "".join(c.choices[0].text for c in chunks)

            while len([n for n in served_by_process(folder).values() if n]) < 2:  # the kernel picks the acceptor
                assert sent < 400, served_by_process(folder)
                assert all(text for text in pool.map(complete, range(sent, sent + 16)))
                sent += 16
        # A stream is counted as its response ends, which may come just after the client read its last chunk.
        deadline = time.monotonic() + 10
        while sum((served := served_by_process(folder)).values()) < sent and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(served) <= processes and sum(served.values()) == sent
        for _ in range(4):  # any process answers /metrics with every process's counts
            assert delta(before, scrape(url + "/metrics"), "nanoserve_gateway_http_requests_total",
                         **COMPLETIONS_OK) == sent
    finally:
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0
    assert len(ready) == 2 and len(processes) >= 2  # the two servers (and multiprocessing's helper)
    deadline = time.monotonic() + 10
    while left := {pid for pid in processes if Path(f"/proc/{pid}").exists()}:
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.1)
    assert folder.is_dir()  # the folder given is left to its owner
    try:
        httpx.get(url + "/health", timeout=5)
        raise AssertionError("still answering after SIGTERM")
    except httpx.TransportError:
        pass


def test_a_busy_port_fails_in_one_line_before_any_process_starts(service, tmp_path):
    log, port = tmp_path / "gateway.log", free_port()
    first = start_gateway(service["address"], port, log=log)
    try:
        wait_listening(f"http://127.0.0.1:{port}", first, log)
        second = start_gateway(service["address"], port, "--api-server-count", "2", log=tmp_path / "second.log")
        assert second.wait(timeout=60) == 1
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    lines = (tmp_path / "second.log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"cannot start: cannot listen on 127.0.0.1:{port} (the gateway's "
                                                 "--port): the port is in use (by another nanoserve, or another "
                                                 "program)"), lines
