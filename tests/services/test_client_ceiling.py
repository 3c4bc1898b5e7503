"""bench/client_ceiling.py: bench/serve.py's client processes against the paced SSE server take
every event the server sends, and the report prices them in CPU seconds."""
import json
import subprocess
import sys

import pytest

from tests.services.processes import ENV, REPO


def test_every_paced_event_reaches_the_client_processes(tmp_path):
    out = tmp_path / "ceiling.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "client_ceiling.py"), "--streams", "6", "--output-len",
                          "5", "--step-ms", "2", "--client-processes", "1", "2", "--server-processes", "1",
                          "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["client_processes"] for r in report["runs"]] == [1, 2] and report["step_ms"] == 2
    for r in report["runs"]:
        assert r["completed"] == 6 and r["offered_messages_per_s"] == 6 / 0.002
        assert r["messages_per_s"] * r["seconds"] == pytest.approx(6 * 5)  # one event a token, each counted once
        assert len(r["cpu_seconds"]) == r["client_processes"] and all(cpu > 0 for cpu in r["cpu_seconds"])
        assert r["messages_per_cpu_second"] > 0
