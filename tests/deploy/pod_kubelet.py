"""A stand-in kubelet for rendered pods: runs their containers' command lines as local processes (in
the namespaces the test made, where the pods' fixed ports are free), probes them as the kubelet does
(gRPC health, HTTP GET, exec), streams one completion through the gateway, then stops the pods the
kubelet's way (SIGTERM to every container at once) and reports what happened as JSON.

    unshare -m -n python -m tests.deploy.pod_kubelet SPEC.json RESULT.json

SPEC: {"containers": [{"name", "ip", "argv", "env", "ports": {name: port}, "startupProbe",
"readinessProbe", "livenessProbe"}], "hosts": {dns name: ip}, "grace_seconds", "log_dir",
"request": {...}, "kill": a container's name, optional}. With "kill", before the stop: the request
streamed undisturbed, then again with that container SIGKILLed at its first event and restarted (as
the kubelet restarts any container of the pod that exits). Each pod has an address of its own on the
loopback interface (`ip`); "hosts" stands in for the cluster's DNS (bind-mounted over /etc/hosts, in
the test's mount namespace).
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from nanoserve.healthcheck import SERVING, serving_status

START_SECONDS = 240
DRAIN_NOTICE_SECONDS = 5  # how soon a stopping pod must leave the Services (readiness fails)


def probe(spec: dict, ip: str, ports: dict[str, int]) -> bool:
    """One probe attempt, as the kubelet makes it, at the pod's address."""
    if "grpc" in spec:
        try:
            return serving_status(f"{ip}:{spec['grpc']['port']}", spec["grpc"].get("service", ""),
                                  timeout=spec.get("timeoutSeconds", 1)) == SERVING
        except grpc.RpcError:
            return False
    if "httpGet" in spec:
        port = spec["httpGet"]["port"]
        url = f"http://{ip}:{ports.get(port, port)}{spec['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=spec.get("timeoutSeconds", 1)) as reply:
                return 200 <= reply.status < 400
        except (urllib.error.URLError, OSError):
            return False
    if "exec" in spec:
        return subprocess.run(spec["exec"]["command"], capture_output=True).returncode == 0
    raise ValueError(f"no handler for probe {spec}")


class Container:
    def __init__(self, spec: dict, log_dir: Path):
        self.spec = spec
        self.name = spec["name"]
        self.log = log_dir / f"{self.name.replace('/', '-')}.log"
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "nanoserve_cli", *self.spec["argv"]],
                                        env={**os.environ, **self.spec["env"]}, stdout=self.log.open("ab"),
                                        stderr=subprocess.STDOUT)

    def probe(self, kind: str) -> bool | None:
        """The probe's verdict, or None when the container has no such probe."""
        return probe(self.spec[kind], self.spec["ip"], self.spec["ports"]) if kind in self.spec else None

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.process.returncode}: "
                               f"{self.log.read_text(errors='replace')[-3000:]}")


def wait_started(containers: list[Container]) -> None:
    """Startup probes, then readiness, as the kubelet gates a pod's readiness."""
    deadline = time.monotonic() + START_SECONDS
    for kind in ("startupProbe", "readinessProbe"):
        for container in containers:
            while container.probe(kind) is False:
                container.check_running()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{container.name}'s {kind} never passed")
                time.sleep(0.5)


class Restarter(threading.Thread):
    """The kubelet's restartPolicy Always for a pod's containers: one that exits is started again."""

    def __init__(self, containers: list[Container]):
        super().__init__(daemon=True)
        self.containers = containers
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            for container in self.containers:
                if container.process.poll() is not None:
                    container.restarts += 1
                    container.start()


class Stream(threading.Thread):
    """One streamed completion through the gateway; `started` is set at its first event."""

    def __init__(self, ip: str, port: int, body: dict):
        super().__init__(daemon=True)
        self.ip, self.port, self.body = ip, port, body
        self.started = threading.Event()
        self.events: list[dict] = []
        self.done = False
        self.error = ""

    def run(self) -> None:
        try:
            connection = http.client.HTTPConnection(self.ip, self.port, timeout=120)
            connection.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                self.error = f"HTTP {reply.status}: {reply.read()[:500]!r}"
                return
            for line in reply:
                line = line.strip()
                if line == b"data: [DONE]":
                    self.done = True
                elif line.startswith(b"data: "):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        except (OSError, http.client.HTTPException) as err:
            self.error = repr(err)
        finally:
            self.started.set()

    def outcome(self) -> dict:
        last = self.events[-1] if self.events else {}
        return {"done": self.done, "error": self.error or last.get("error", ""),
                "finish_reason": last.get("choices", [{}])[0].get("finish_reason"),
                "text": "".join(event["choices"][0]["text"] for event in self.events if event.get("choices"))}


def completion(gateway: Container, body: dict, kill: Container | None = None) -> dict:
    """A streamed completion to its end; with `kill`, that container is SIGKILLed at the first event."""
    stream = Stream(gateway.spec["ip"], gateway.spec["ports"]["http"], body)
    stream.start()
    if kill:
        stream.started.wait(120)
        kill.process.kill()
    stream.join(START_SECONDS)
    return stream.outcome()


def network(spec: dict) -> None:
    """Loopback up (every 127.x.y.z address is then local: one a pod), the pods' DNS names in /etc/hosts."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if spec.get("hosts"):
        hosts = Path(spec["log_dir"]) / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in spec["hosts"].items()))
        subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)


def run(spec: dict) -> dict:
    network(spec)
    log_dir = Path(spec["log_dir"])
    containers = [Container(c, log_dir) for c in spec["containers"]]
    [gateway] = [c for c in containers if c.name.endswith("gateway")]
    result: dict = {}
    try:
        wait_started(containers)
        result["live"] = {c.name: c.probe("livenessProbe") for c in containers}
        if spec.get("kill"):  # a crash in a running pod: the kubelet restarts that container alone
            undisturbed = completion(gateway, spec["request"])
            restarter = Restarter(containers)
            restarter.start()
            killed = completion(gateway, spec["request"], next(c for c in containers if c.name == spec["kill"]))
            wait_started(containers)
            restarter.stopping.set()
            restarter.join()
            result["kill"] = {"undisturbed": undisturbed, "killed": killed,
                              "restarts": {c.name: c.restarts for c in containers}}
        stream = Stream(gateway.spec["ip"], gateway.spec["ports"]["http"], spec["request"])
        stream.start()
        stream.started.wait(120)
        stopped_at = time.monotonic()
        for container in containers:  # the kubelet's SIGTERM, to every container at once
            container.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + DRAIN_NOTICE_SECONDS
        while gateway.probe("readinessProbe") and time.monotonic() < deadline:
            time.sleep(0.1)
        result["draining"] = {c.name: {kind: c.probe(kind) for kind in ("readinessProbe", "livenessProbe")}
                              for c in containers if c.process.poll() is None}
        stream.join(spec["grace_seconds"])
        result["stream"] = stream.outcome()
        for container in containers:
            left = spec["grace_seconds"] - (time.monotonic() - stopped_at)
            try:
                container.process.wait(max(left, 0.1))
            except subprocess.TimeoutExpired:
                pass
        result["exit"] = {c.name: c.process.poll() for c in containers}
        result["stop_seconds"] = time.monotonic() - stopped_at
    except RuntimeError as err:
        result["error"] = str(err)
    finally:
        for container in containers:  # the kubelet's SIGKILL after the grace period
            if container.process.poll() is None:
                container.process.kill()
                container.process.wait()
    return result


if __name__ == "__main__":
    spec_path, result_path = sys.argv[1:3]
    Path(result_path).write_text(json.dumps(run(json.loads(Path(spec_path).read_text()))))
