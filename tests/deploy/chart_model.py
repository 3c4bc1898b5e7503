"""The Helm chart as the tests see it: rendered by the real helm binary, validated by the Kubernetes
schemas (kubernetes-validate for built-in kinds, the CRDs in crds/ for custom ones), and read back as
pods, containers and the nanoserve command lines they run."""
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from nanoserve import flags

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "nanoserve"
PROFILES = CHART / "profiles"
CRDS = Path(__file__).resolve().parent / "crds"
RELEASE, NAMESPACE = "demo", "serving"
FULLNAME = f"{RELEASE}-nanoserve"  # the chart's resources are named after it
NO_HELM = "no helm binary: `make install` puts one in .venv/bin (deploy/helm/install-helm.sh)"
# The environment the kubelet and the LeaderWorkerSet controller give a container, for expanding
# $(VAR) in its arguments as the kubelet does: in the second group (and its rank and size, below).
POD_ENV = {"LWS_LEADER_ADDRESS": f"{FULLNAME}-1.{FULLNAME}.{NAMESPACE}",
           "GROUP_INDEX": "1", "NAMESPACE": NAMESPACE}


def helm() -> str:
    """The helm binary, beside this interpreter (make install) or on PATH; CI must have one."""
    found = shutil.which("helm", path=os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"])))
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(NO_HELM)
    pytest.skip(NO_HELM)


def helm_args(profile: Path | None, sets: dict[str, Any]) -> list[str]:
    return [*(["--values", str(profile)] if profile else []),
            *(word for key, value in sets.items() for word in ("--set-json", f"{key}={json.dumps(value)}"))]


def lint(profile: Path | None = None, **sets: Any) -> subprocess.CompletedProcess:
    """`helm lint --strict` of the chart with a profile and values (dotted key=value, --set-json)."""
    return subprocess.run([helm(), "lint", "--strict", str(CHART), *helm_args(profile, sets)],
                          capture_output=True, text=True, timeout=120)


def render(profile: Path | None = None, **sets: Any) -> list[dict]:
    """The manifests `helm template` makes, as dicts (fails the test with helm's message)."""
    result = subprocess.run([helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                             *helm_args(profile, sets)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def schema_errors(doc: dict, version: str) -> str:
    """'' when the document is valid: built-in kinds by kubernetes-validate --strict at this
    Kubernetes version, custom ones by their CRD; the first error otherwise."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return custom_errors(doc)
    except kubernetes_validate.ValidationError as err:
        return f"{doc['kind']} {doc['metadata'].get('name')}: {err.message}"
    return ""


def _strict(schema):
    """A CRD schema that refuses unknown fields, as the API server's strict field validation does
    (structural schemas otherwise prune them silently)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict JSON schema of every served version of the CRDs in crds/."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        for version in crd["spec"]["versions"]:
            if version["served"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def custom_errors(doc: dict) -> str:
    """'' when the CRD of the document's kind accepts it; the first error otherwise."""
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        return f"no CRD in {CRDS} for {doc['apiVersion']} {doc['kind']}"
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(doc))
    return "" if error is None else f"{doc['kind']} {doc['metadata'].get('name')}: {error.message} at " \
                                    f"{'/'.join(map(str, error.absolute_path))}"


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [doc for doc in of_kind(docs, kind) if name is None or doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in the chart's output"
    return found[0]


@dataclass
class Pod:
    """A pod template: its labels and spec, where it came from ('Deployment', 'leader', 'worker')."""
    origin: str
    labels: dict
    spec: dict

    def container(self, name: str) -> dict:
        found = [c for c in self.spec["containers"] if c["name"] == name]
        assert found, f"no {name} container in the {self.origin} pod"
        return found[0]

    def names(self) -> list[str]:
        return [c["name"] for c in self.spec["containers"]]


def component(template: dict) -> str:
    return template["metadata"]["labels"].get("app.kubernetes.io/component", "")


def pod_templates(docs: list[dict]) -> list[Pod]:
    """Every pod template of the output: Deployments' (the origin names the component) and the
    LeaderWorkerSet's leader and worker templates."""
    out = [Pod(component(d["spec"]["template"]) if component(d["spec"]["template"]) != "server" else "Deployment",
               d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
           for d in of_kind(docs, "Deployment")]
    for lws in of_kind(docs, "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        out += [Pod(origin, template[key]["metadata"]["labels"], template[key]["spec"])
                for origin, key in (("leader", "leaderTemplate"), ("worker", "workerTemplate"))]
    return out


def pods(docs: list[dict]) -> list[Pod]:
    """The replicas' pod templates (not the routers')."""
    return [pod for pod in pod_templates(docs) if pod.origin in ("Deployment", "leader", "worker")]


def expand(word: str, env: dict[str, str]) -> str:
    """$(VAR) replaced as the kubelet does for variables the container has; others stay as written."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), word)


class BadCommandLine(ValueError):
    """A container's arguments that nanoserve's own parser refuses."""


def command_line(container: dict, group_size: int = 1, rank: int = 1):
    """(command, the argparse namespace nanoserve's own parser makes of the container's arguments in
    a pod of rank `rank` of a group), or BadCommandLine: a flag the command does not take, a bad value."""
    env = {**POD_ENV, "LWS_GROUP_SIZE": str(group_size), "LWS_WORKER_INDEX": str(rank)}
    args = [expand(str(word), env) for word in container["args"]]
    command, argv = args[0], args[1:]
    try:
        return command, flags.parse(command, argv, prog=f"nanoserve {command}")
    except SystemExit:
        raise BadCommandLine(f"`nanoserve {' '.join(args)}` ({container['name']} container) does not parse") from None


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
