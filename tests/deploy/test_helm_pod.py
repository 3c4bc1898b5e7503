"""The chart's Deployment pod run as the kubelet runs it: its three containers' rendered command lines
and environment (the worker token from the rendered Secret) as processes, in a network namespace of
their own where the pod's fixed ports are free, probed with the rendered probes; a streamed request
through the gateway, then SIGTERM to every container at once, as a rolling update does. The request
finishes, each container exits 0, all within the pod's terminationGracePeriodSeconds."""
import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart_model import REPO, expand, of_kind, pods, render
from tests.services.processes import ENV

MAX_TOKENS = 300


def can_unshare() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-n", "true"]).returncode == 0


def container_spec(container: dict, secrets: dict[str, dict], model_root: Path) -> dict:
    """What the stand-in kubelet runs: the arguments with the model volume's mount point (/models)
    replaced by where the model is on this machine, the environment with Secrets resolved."""
    env = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            ref = variable["valueFrom"]["secretKeyRef"]
            env[variable["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
    argv = [expand(str(word), env).replace("/models/", f"{model_root}/", 1) for word in container["args"]]
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}
    return {"name": container["name"], "argv": argv, "env": env,
            "ports": {port["name"]: port["containerPort"] for port in container.get("ports", [])}, **probes}


@pytest.mark.skipif(not can_unshare(), reason="needs `unshare -n` (a network namespace of the test's own)")
def test_the_rendered_pod_serves_then_drains_on_sigterm(tiny_model_dir, tmp_path):
    docs = render(**{"model.name": tiny_model_dir.name, "model.download.enabled": False, "shutdownTimeout": 30,
                     "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512},
                     "worker.flags": {"blockSize": 16, "numKvBlocks": 256},
                     "gateway.flags": {"apiServerCount": 1}})
    [pod] = pods(docs)
    secrets = {secret["metadata"]["name"]: secret for secret in of_kind(docs, "Secret")}
    spec = {"containers": [container_spec(c, secrets, tiny_model_dir.parent) for c in pod.spec["containers"]],
            "grace_seconds": pod.spec["terminationGracePeriodSeconds"], "log_dir": str(tmp_path),
            "request": {"model": tiny_model_dir.name, "prompt": "The sea", "max_tokens": MAX_TOKENS,
                        "ignore_eos": True, "stream": True}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run(["unshare", "-n", sys.executable, "-m", "tests.deploy.pod_kubelet", tmp_path / "spec.json",
                    tmp_path / "result.json"], env=ENV, cwd=REPO, check=True, timeout=400)
    result = json.loads((tmp_path / "result.json").read_text())
    logs = {path.name: path.read_text(errors="replace")[-2000:] for path in tmp_path.glob("*.log")}
    assert "error" not in result, (result, logs)
    assert result["live"] == {"worker": True, "scheduler": True, "gateway": None}
    # a second after SIGTERM: out of the Services (not ready), yet alive (no liveness restart)
    draining = result["draining"]
    assert draining["gateway"]["readinessProbe"] is False, (result, logs)
    assert draining["scheduler"] == {"readinessProbe": False, "livenessProbe": True}, (result, logs)
    assert result["stream"] == {"done": True, "error": "", "events": result["stream"]["events"],
                                "finish_reason": "length"}, (result, logs)
    assert result["exit"] == {"worker": 0, "scheduler": 0, "gateway": 0}, (result, logs)
    assert result["stop_seconds"] < spec["grace_seconds"]
