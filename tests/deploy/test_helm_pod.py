"""The chart's pods run as the kubelet runs them: each container's rendered command line and
environment (the worker token from the rendered Secret, the LeaderWorkerSet's variables, the downward
API) as processes, in namespaces of the test's own where the pods' fixed ports are free and their DNS
names resolve, probed with the rendered probes; a streamed request through the gateway, then SIGTERM to
every container at once, as a rolling update does. The request finishes, the probes say not ready but
alive meanwhile, every container exits 0, all within the pod's terminationGracePeriodSeconds."""
import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart_model import FULLNAME, NAMESPACE, PROFILES, REPO, expand, of_kind, pods, render
from tests.services.processes import ENV

MAX_TOKENS = 100  # in flight when SIGTERM comes (at its first event), done well within the drain on a loaded machine
FINISHED = {"done": True, "error": "", "finish_reason": "length"}
# The downward API's answers for the second group (the LeaderWorkerSet's group-index label).
DOWNWARD_API = {"metadata.labels['leaderworkerset.sigs.k8s.io/group-index']": "1", "metadata.namespace": NAMESPACE}


def can_unshare() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-m", "-n", "true"]).returncode == 0


def container_spec(container: dict, pod_ip: str, env: dict[str, str], secrets: dict[str, dict],
                   model_root: Path) -> dict:
    """What the stand-in kubelet runs: the arguments with the model volume's mount point (/models)
    replaced by where the model is on this machine and the pod's own addresses (every address,
    loopback) by the pod's address here; the environment with Secrets and the downward API resolved."""
    env = dict(env)
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[variable["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
        else:
            env[variable["name"]] = DOWNWARD_API[source["fieldRef"]["fieldPath"]]
    argv = [expand(str(word), env).replace("/models/", f"{model_root}/", 1) for word in container["args"]]
    argv = [{"0.0.0.0": pod_ip}.get(word, word.replace("127.0.0.1:", f"{pod_ip}:")) for word in argv]
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")
              if kind in container}
    return {"name": container["name"], "ip": pod_ip, "argv": argv, "env": env,
            "ports": {port["name"]: port["containerPort"] for port in container.get("ports", [])}, **probes}


def run_pods(docs: list[dict], model_dir: Path, tmp_path: Path, pod_env: list[tuple[str, dict]],
             hosts: dict[str, str], kill: str = "") -> tuple[dict, dict]:
    """Runs the replica's pods (each with its address and LeaderWorkerSet variables) under the stand-in
    kubelet, in mount and network namespaces of the test's own; (the result, the containers' logs)."""
    secrets = {secret["metadata"]["name"]: secret for secret in of_kind(docs, "Secret")}
    containers = []
    for pod, (ip, env) in zip(pods(docs), pod_env):
        for container in pod.spec["containers"]:
            spec = container_spec(container, ip, env, secrets, model_dir.parent)
            containers.append({**spec, "name": f"{pod.origin}/{container['name']}"})
    spec = {"containers": containers, "hosts": hosts, "log_dir": str(tmp_path),
            "grace_seconds": pods(docs)[0].spec["terminationGracePeriodSeconds"],
            "request": {"model": model_dir.name, "prompt": "The sea", "max_tokens": MAX_TOKENS,
                        "ignore_eos": True, "temperature": 0, "stream": True}, "kill": kill}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run(["unshare", "-m", "-n", sys.executable, "-m", "tests.deploy.pod_kubelet", tmp_path / "spec.json",
                    tmp_path / "result.json"], env=ENV, cwd=REPO, check=True, timeout=400)
    logs = {path.name: path.read_text(errors="replace")[-2000:] for path in tmp_path.glob("*.log")}
    return json.loads((tmp_path / "result.json").read_text()), logs


def small(model_dir: Path, **values) -> dict:
    """Values for the tiny model on CPU, its cache already filled."""
    return {"model.name": model_dir.name, "model.download.enabled": False, "shutdownTimeout": 60,
            "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512},
            "worker.flags": {"blockSize": 16, "numKvBlocks": 256}, "gateway.flags": {"apiServerCount": 1}, **values}


def assert_served_then_drained(result: dict, logs: dict, grace_seconds: int, leader: str) -> None:
    assert "error" not in result, (result, logs)
    assert {name: live for name, live in result["live"].items() if live is not None} == {
        name: True for name in result["live"] if not name.endswith("gateway")}
    # soon after SIGTERM: out of the Services (not ready), yet alive (no liveness restart)
    draining = result["draining"]
    assert draining[f"{leader}/gateway"]["readinessProbe"] is False, (result, logs)
    assert draining[f"{leader}/scheduler"] == {"readinessProbe": False, "livenessProbe": True}, (result, logs)
    assert result["stream"] == {**FINISHED, "text": result["stream"]["text"]}, (result, logs)
    assert set(result["exit"].values()) == {0}, (result, logs)
    assert result["stop_seconds"] < grace_seconds


pytestmark = pytest.mark.skipif(not can_unshare(), reason="needs `unshare -m -n` (namespaces of the test's own)")


def test_the_rendered_pod_serves_then_drains_on_sigterm(tiny_model_dir, tmp_path):
    docs = render(**small(tiny_model_dir))
    result, logs = run_pods(docs, tiny_model_dir, tmp_path, [("127.0.0.1", {})], {})
    assert set(result["exit"]) == {"Deployment/worker", "Deployment/scheduler", "Deployment/gateway"}
    assert_served_then_drained(result, logs, pods(docs)[0].spec["terminationGracePeriodSeconds"], "Deployment")


def test_a_leader_worker_set_group_serves_across_two_pods(tiny_model_dir, tmp_path):
    """A group of two pods, each at an address of its own, their names resolved as the cluster's DNS
    would: the ranks meet at the leader's address, the leader's scheduler dials both by name; a rank
    killed mid-stream is a pause; deleting the group (SIGTERM everywhere) drains it."""
    docs = render(PROFILES / "multi-host.yaml", **small(tiny_model_dir, **{
        "worker.env": [{"name": "GLOO_SOCKET_IFNAME", "value": "lo"}]}))
    leader_name = f"{FULLNAME}-1.{FULLNAME}.{NAMESPACE}"
    rank_name = f"{FULLNAME}-1-1.{FULLNAME}.{NAMESPACE}"
    lws = {"LWS_LEADER_ADDRESS": leader_name, "LWS_GROUP_SIZE": "2"}
    result, logs = run_pods(docs, tiny_model_dir, tmp_path,
                            [("127.0.0.2", {**lws, "LWS_WORKER_INDEX": "0"}),
                             ("127.0.0.3", {**lws, "LWS_WORKER_INDEX": "1"})],
                            {leader_name: "127.0.0.2", rank_name: "127.0.0.3"}, kill="worker/worker")
    assert set(result["exit"]) == {"leader/worker", "leader/scheduler", "leader/gateway", "worker/worker"}
    # restartPolicy None: rank 1 killed mid-stream restarts alone, rank 0 leaves the broken group and
    # restarts in place, the scheduler holds the request: it finishes with the undisturbed run's text
    kill = result.get("kill", {})
    assert kill.get("undisturbed", {}).get("finish_reason") == "length", (result, logs)
    assert kill["killed"] == kill["undisturbed"], (result, logs)
    restarts = kill["restarts"]
    assert restarts["worker/worker"] >= 1 and restarts["leader/worker"] >= 1, (result, logs)
    assert restarts["leader/scheduler"] == restarts["leader/gateway"] == 0, (result, logs)
    assert_served_then_drained(result, logs, pods(docs)[0].spec["terminationGracePeriodSeconds"], "leader")
    assert "rank 1/2 loading" in (tmp_path / "worker-worker.log").read_text()
