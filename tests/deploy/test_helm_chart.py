"""deploy/helm/nanoserve: `helm lint` and `helm template` by the real helm binary for every values
profile, every manifest valid for Kubernetes (kubernetes-validate --strict, the CRDs in crds/), and
the replica's wiring holds on what is rendered: each container's command line parses with
nanoserve's own flag table, ports, probes, Services, volumes and Secrets meet."""
from functools import cache
from pathlib import Path

import pytest
import yaml

from nanoserve import flags
from tests.deploy.chart_model import (CHART, FULLNAME, NAMESPACE, POD_ENV, PROFILES, BadCommandLine, Pod, command_line,
                                      lint, of_kind, one, pod_templates, pods, port_of, render, schema_errors)
from worker_svc.stopping import RELEASE_MARGIN_SECONDS

ALL_PROFILES = [None, *sorted(PROFILES.glob("*.yaml"))]
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
KUBERNETES = (yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"].strip(">=").split("-")[0], "1.37.0")
ENGINE = {"maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "maxModelLen": 2048}
SERVICES = ("worker", "scheduler", "gateway")


def profile_id(profile: Path | None) -> str:
    return profile.stem if profile else "defaults"


@cache
def rendered(profile: Path | None) -> list[dict]:
    return render(profile)


def server_pods(docs: list[dict]) -> list[Pod]:
    return [pod for pod in pods(docs) if pod.origin in ("Deployment", "leader")]


@pytest.mark.parametrize("profile", ALL_PROFILES, ids=profile_id)
def test_lint_passes(profile):
    result = lint(profile)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("profile", ALL_PROFILES, ids=profile_id)
def test_every_manifest_is_valid_kubernetes(profile, version):
    docs = rendered(profile)
    assert docs
    assert [error for doc in docs if (error := schema_errors(doc, version))] == []


@pytest.mark.parametrize("profile", ALL_PROFILES, ids=profile_id)
def test_every_container_runs_a_command_line_nanoserve_parses(profile):
    docs = rendered(profile)
    for pod in pods(docs):
        for container in pod.spec["containers"]:
            if container["name"] in SERVICES:
                command, _ = command_line(container, group_size=2)
                assert command == container["name"]


def test_a_deployment_pod_is_one_whole_replica():
    docs = render(engine=ENGINE)
    [pod] = pods(docs)
    assert pod.names() == ["worker", "scheduler", "gateway"]
    _, worker = command_line(pod.container("worker"))
    _, scheduler = command_line(pod.container("scheduler"))
    _, gateway = command_line(pod.container("gateway"))
    assert (worker.rank, worker.tensor_parallel_size) == (0, 1)
    assert scheduler.workers == f"127.0.0.1:{worker.port}"
    assert port_of(gateway.scheduler) == scheduler.port
    # the limits both sides must agree on reach both
    for args in (worker, scheduler):
        assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == tuple(ENGINE.values())
    # the scheduler waits for its workers as long as the kubelet lets them load
    assert scheduler.worker_connect_timeout == VALUES["worker"]["startupSeconds"]
    assert one(docs, "Deployment", FULLNAME)["spec"]["replicas"] == VALUES["replicas"]


def test_probes_ask_the_ports_the_services_listen_on():
    [pod] = pods(rendered(None))
    _, worker = command_line(pod.container("worker"))
    _, scheduler = command_line(pod.container("scheduler"))
    _, gateway = command_line(pod.container("gateway"))
    for probe in ("startupProbe", "livenessProbe"):
        assert pod.container("worker")[probe]["grpc"] == {"port": worker.port}
    probes = pod.container("scheduler")
    assert probes["startupProbe"]["grpc"] == probes["readinessProbe"]["grpc"] == {"port": scheduler.port}
    # liveness asks a health service that stays SERVING while a worker group is rebuilt
    assert probes["livenessProbe"]["grpc"] == {"port": scheduler.port, "service": "liveness"}
    readiness = pod.container("gateway")["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health"
    assert container_port(pod, "gateway", readiness["port"]) == gateway.port
    assert "livenessProbe" not in pod.container("gateway")


def test_worker_links_use_tls_from_the_secret():
    [pod] = pods(render(**{"tls.workerSecret": "worker-tls"}))
    _, worker = command_line(pod.container("worker"))
    _, scheduler = command_line(pod.container("scheduler"))
    files = (worker.tls_cert_file, worker.tls_key_file, worker.tls_ca_file)
    # mutual TLS: the scheduler checks the workers against the CA and presents the same certificate
    assert (scheduler.worker_tls_cert_file, scheduler.worker_tls_key_file, scheduler.worker_tls_ca_file) == files
    [volume] = [v for v in pod.spec["volumes"] if v.get("secret", {}).get("secretName") == "worker-tls"]
    mount = {m["name"]: m["mountPath"] for m in pod.container("worker")["volumeMounts"]}[volume["name"]]
    assert all(path.startswith(mount + "/") for path in files)
    # the kubelet's gRPC probe cannot speak TLS: nanoserve's probe asks the worker with its files
    for probe in ("startupProbe", "livenessProbe"):
        argv = pod.container("worker")[probe]["exec"]["command"]
        assert argv[:3] == ["python", "-m", "nanoserve.healthcheck"]
        asked = flags.parse("healthcheck", argv[3:])
        assert port_of(asked.address) == worker.port
        assert (asked.tls_cert_file, asked.tls_key_file, asked.tls_ca_file) == files


def container_port(pod: Pod, container: str, name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in pod.container(container).get("ports", [])}
    assert name in ports, f"no port {name} on the {container} container"
    return ports[name]


@pytest.mark.parametrize("profile", ALL_PROFILES, ids=profile_id)
def test_services_and_disruption_budget_select_the_pods(profile):
    docs = rendered(profile)
    templates = pod_templates(docs)
    for service in of_kind(docs, "Service"):
        selector = service["spec"]["selector"]
        matched = [pod for pod in templates if selector.items() <= pod.labels.items()]
        assert matched, f"Service {service['metadata']['name']} selects no pod"
        for pod in matched:
            for port in service["spec"]["ports"]:
                assert any(port["targetPort"] in {p["name"] for p in c.get("ports", [])}
                           for c in pod.spec["containers"]), (service["metadata"]["name"], port)
        if service["metadata"]["name"] in (f"{FULLNAME}-openai", f"{FULLNAME}-grpc"):
            assert {pod.origin for pod in matched} <= {"Deployment", "leader"}  # the pods that serve the APIs
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]
        [components] = [e["values"] for e in selector["matchExpressions"] if e["key"] == "app.kubernetes.io/component"]
        for pod in pods(docs):
            assert selector["matchLabels"].items() <= pod.labels.items()
            assert pod.labels["app.kubernetes.io/component"] in components
        for router in of_kind(docs, "Deployment"):
            labels = router["spec"]["template"]["metadata"]["labels"]
            if labels["app.kubernetes.io/component"] == "router":
                assert labels["app.kubernetes.io/component"] not in components


def test_openai_and_grpc_services_reach_the_gateway_and_the_scheduler():
    docs = rendered(None)
    [pod] = pods(docs)
    _, scheduler = command_line(pod.container("scheduler"))
    _, gateway = command_line(pod.container("gateway"))
    openai = one(docs, "Service", f"{FULLNAME}-openai")["spec"]["ports"]
    grpc = one(docs, "Service", f"{FULLNAME}-grpc")["spec"]["ports"]
    assert [container_port(pod, "gateway", p["targetPort"]) for p in openai] == [gateway.port]
    assert [container_port(pod, "scheduler", p["targetPort"]) for p in grpc] == [scheduler.port]


def values_of(profile: Path | None) -> dict:
    """The values a profile gives, over the chart's defaults (one level deep is all the tests read)."""
    given = yaml.safe_load(profile.read_text()) if profile else {}
    return {key: {**value, **given.get(key, {})} if isinstance(value, dict) else given.get(key, value)
            for key, value in VALUES.items()}


@pytest.mark.parametrize("profile", ALL_PROFILES, ids=profile_id)
def test_pods_get_the_model_the_token_and_gpus(profile):
    docs = rendered(profile)
    secrets = {doc["metadata"]["name"] for doc in of_kind(docs, "Secret")}
    for pod in pods(docs):
        volumes = {volume["name"] for volume in pod.spec["volumes"]}
        assert pod.labels["llm-d.ai/engine-type"] == "nanoserve"
        _, worker = command_line(pod.container("worker"), group_size=2)
        for container in pod.spec["containers"]:
            mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
            assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"]
            assert set(mounts) <= volumes
            gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            assert (gpus == 1) == (container["name"] == "worker"), container["name"]
            token = [env for env in container.get("env", []) if env["name"] == "NANOSERVE_WORKER_TOKEN"]
            if container["name"] == "gateway":
                assert token == []
            else:
                [token] = token
                name = token["valueFrom"]["secretKeyRef"]["name"]
                assert name in secrets or name == values_of(profile)["workerToken"]["existingSecret"]
        assert worker.model == f"/models/{values_of(profile)['model']['name']}"
        for init in pod.spec.get("initContainers", []):
            assert init["args"][init["args"].index("--local-dir") + 1] == worker.model


def test_drain_gets_its_grace_period():
    """Every container drains for shutdownTimeout on SIGTERM (the worker until its scheduler lets go of
    it, a few seconds past that); the kubelet's SIGKILL comes only after all of it."""
    [pod] = pods(render(shutdownTimeout=45, terminationMarginSeconds=10))
    for name in SERVICES:
        assert command_line(pod.container(name))[1].shutdown_timeout == 45
    assert pod.spec["terminationGracePeriodSeconds"] == 55 > 45 + RELEASE_MARGIN_SECONDS
    result = lint(terminationMarginSeconds=RELEASE_MARGIN_SECONDS)
    assert result.returncode != 0 and "at '/terminationMarginSeconds'" in result.stdout + result.stderr


# Values that must not install: values.schema.json refuses each, naming this in its message.
BAD_VALUES = {
    "replicas as text": ({"replicas": "two"}, "at '/replicas'"),
    "a misspelt key": ({"replica": 2}, "'replica' not allowed"),
    "a flag the chart sets itself": ({"worker.flags": {"rank": 1}}, "propertyName 'rank'"),
    "a limit given to one side only": ({"scheduler.flags": {"maxNumSeqs": 8}}, "propertyName 'maxNumSeqs'"),
    "a group of one rank": ({"workload": "LeaderWorkerSet", "leaderWorkerSet.size": 1}, "at '/leaderWorkerSet/size'"),
    "an unknown restart policy": ({"leaderWorkerSet.restartPolicy": "Sometimes"},
                                  "at '/leaderWorkerSet/restartPolicy'"),
    "an unknown router": ({"router.type": "nginx"}, "at '/router/type'"),
    "a model path that climbs": ({"model.name": "../../etc"}, "at '/model/name'"),
    "a port out of range": ({"service.openai.port": 70000}, "at '/service/openai/port'"),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=str)
def test_bad_values_fail_lint(case):
    sets, where = BAD_VALUES[case]
    result = lint(**sets)
    assert result.returncode != 0, f"{case}: helm lint passed"
    assert where in result.stdout + result.stderr


def test_validators_refuse_broken_manifests():
    """The checks above can fail: kubernetes-validate refuses a wrong type and an unknown field."""
    deployment = one(rendered(None), "Deployment", FULLNAME)
    wrong_type = {**deployment, "spec": {**deployment["spec"], "replicas": "2"}}
    unknown_field = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    no_containers = yaml.safe_load(yaml.safe_dump(deployment))
    del no_containers["spec"]["template"]["spec"]["containers"]
    for broken in (wrong_type, unknown_field, no_containers):
        assert schema_errors(broken, KUBERNETES[-1])
    assert schema_errors(deployment, KUBERNETES[-1]) == ""


def test_flag_check_refuses_a_flag_of_another_command():
    """maxRequestBytes is a scheduler flag: given to the worker, nanoserve's parser refuses it."""
    [pod] = pods(render(**{"worker.flags": {"maxRequestBytes": 1024}}))
    with pytest.raises(BadCommandLine, match="max-request-bytes"):
        command_line(pod.container("worker"))


def test_a_leader_worker_set_group_is_one_tensor_parallel_replica():
    """Each rank gets its rank, the group's size and the leader's address from the variables the
    LeaderWorkerSet controller sets; the leader's scheduler dials every rank at the DNS name its pod
    has (<set>-<group>-<rank>.<set>.<namespace>, the leader <set>-<group>), in rank order."""
    size = 4
    docs = render(PROFILES / "multi-host.yaml", **{"leaderWorkerSet.size": size})
    lws = one(docs, "LeaderWorkerSet")
    name, group = lws["metadata"]["name"], POD_ENV["GROUP_INDEX"]
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == size
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "None"
    assert spec["startupPolicy"] == "LeaderCreated"  # LeaderReady would wait forever: ready needs the ranks
    leader, worker_pod = pods(docs)
    assert (leader.names(), worker_pod.names()) == (["worker", "scheduler", "gateway"], ["worker"])
    for pod, rank in ((leader, 0), (worker_pod, 3)):
        _, worker = command_line(pod.container("worker"), size, rank)
        assert (worker.rank, worker.tensor_parallel_size) == (rank, size)
        assert worker.dist_init_addr == f"{POD_ENV['LWS_LEADER_ADDRESS']}:{VALUES['leaderWorkerSet']['distInitPort']}"
        assert worker.host == "0.0.0.0"  # reached from the leader's pod
    assert container_port(leader, "worker", "dist-init") == VALUES["leaderWorkerSet"]["distInitPort"]
    for pod in (leader, worker_pod):  # the profile picks the interface the ranks talk over
        assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in pod.container("worker")["env"]
    _, scheduler = command_line(leader.container("scheduler"), size)
    port = command_line(leader.container("worker"), size, 0)[1].port
    expected = [f"{name}-{group}.{name}.{NAMESPACE}:{port}"] + [
        f"{name}-{group}-{rank}.{name}.{NAMESPACE}:{port}" for rank in range(1, size)]
    assert scheduler.workers.split(",") == expected
    assert POD_ENV["LWS_LEADER_ADDRESS"] == f"{name}-{group}.{name}.{NAMESPACE}"
    group_env = {env["name"]: env["valueFrom"]["fieldRef"]["fieldPath"] for env in leader.container("scheduler")["env"]
                 if "fieldRef" in env.get("valueFrom", {})}
    assert group_env == {"GROUP_INDEX": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']",
                         "NAMESPACE": "metadata.namespace"}
    # only the leader serves the APIs: the Services and routers select it, not the ranks
    assert leader.labels["app.kubernetes.io/component"] == "server"
    assert worker_pod.labels["app.kubernetes.io/component"] == "rank"


@pytest.mark.parametrize("policy", ["None", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart"])
def test_group_restart_policy_is_chosen_by_value(policy):
    docs = render(PROFILES / "multi-host.yaml", **{"leaderWorkerSet.restartPolicy": policy})
    lws = one(docs, "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == policy
    assert schema_errors(lws, KUBERNETES[-1]) == ""


def test_crd_schemas_refuse_broken_leader_worker_sets():
    lws = one(render(PROFILES / "multi-host.yaml"), "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    broken = {
        "size as text": {**template, "size": "two"},
        "an unknown restart policy": {**template, "restartPolicy": "Sometimes"},
        "a misspelt field": {**template, "sizes": 2},
        "no worker template": {key: value for key, value in template.items() if key != "workerTemplate"},
    }
    for case, bad in broken.items():
        assert schema_errors({**lws, "spec": {**lws["spec"], "leaderWorkerTemplate": bad}}, KUBERNETES[-1]), case
    containers = yaml.safe_load(yaml.safe_dump(lws))
    containers["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["ports"][0][
        "containerPort"] = "fifty"
    assert schema_errors(containers, KUBERNETES[-1]), "a port as text inside the pod template"
