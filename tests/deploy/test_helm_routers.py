"""The chart's routers, on what `helm template` renders: SMG finds exactly the pods that serve the
OpenAI API, with the arguments its own parser accepts and no more rights than listing pods; the llm-d
profile's InferencePool, endpoint picker and HTTPRoute meet each other and nanoserve's pods."""
from importlib import metadata

import pytest
import yaml

from nanoserve.flags import defaults
from nanoserve_cli.router import LOAD_POLL_SECONDS, overload_flags
from tests.deploy.chart_model import (CHART, FULLNAME, NAMESPACE, PROFILES, REPO, command_line, of_kind, one,
                                      pod_templates, pods, render, schema_errors)

ROUTER = f"{FULLNAME}-router"


def router_kinds(docs: list[dict]) -> set[str]:
    return {doc["kind"] for doc in docs if doc["metadata"]["name"].startswith(ROUTER)}


@pytest.mark.parametrize("profile", [None, PROFILES / "multi-host.yaml"], ids=["deployment", "multi-host"])
def test_smg_discovers_the_pods_that_serve_the_openai_api(profile):
    launch_router = pytest.importorskip("smg.launch_router", reason="SMG's parser comes with `pip install smg`")
    docs = render(profile)
    router = one(docs, "Deployment", ROUTER)["spec"]["template"]
    [container] = router["spec"]["containers"]
    args = launch_router.parse_router_args(container["args"])  # SMG's own parser, as the router image runs it
    args._validate_router_args()
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    assert args.policy == "cache_aware"
    assert args.load_monitor_interval == LOAD_POLL_SECONDS  # as `nanoserve up` runs SMG
    for pod in pod_templates(docs):
        selected = args.selector.items() <= pod.labels.items()
        assert selected == (pod.origin in ("Deployment", "leader")), pod.origin
        if selected:
            _, gateway = command_line(pod.container("gateway"), group_size=2)
            assert args.service_discovery_port == gateway.port
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (ports["http"], ports["metrics"]) == (args.port, args.prometheus_port)


def test_smg_runs_in_nanoserves_router_image_unless_told_otherwise():
    """The router image (docker/router.Dockerfile) at the chart's version, as the chart's other images: its
    entrypoint, which the pod keeps, is SMG's launcher as `nanoserve up` runs it, the arguments follow it.
    SMG's official image, at the release the router image pins, is a choice of values, with the same arguments."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    [container] = one(render(), "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"nanoserve-router:{app_version}" and "command" not in container
    official = {"router.smg.image.repository": "lightseekorg/smg", "router.smg.image.tag": metadata.version("smg")}
    [theirs] = one(render(**official), "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"]
    assert theirs["image"] == f"lightseekorg/smg:{metadata.version('smg')}" and theirs["args"] == container["args"]


@pytest.mark.parametrize("max_num_seqs", [None, 64])
def test_smg_counts_a_replica_overloaded_as_up_does(max_num_seqs):
    """A whole batch waiting (the engine's --max-num-seqs, the flag table's default when unset) or a
    full pool, the thresholds `nanoserve up` gives SMG."""
    docs = render(**({"engine.maxNumSeqs": max_num_seqs} if max_num_seqs else {}))
    [container] = one(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"]
    expected = overload_flags(max_num_seqs or defaults("up")["max_num_seqs"])
    start = container["args"].index(expected[0])
    assert container["args"][start:start + len(expected)] == expected


def test_smg_may_only_read_pods_in_its_namespace():
    docs = render()
    assert router_kinds(docs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    role = one(docs, "Role", ROUTER)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", ROUTER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER}
    account = one(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert one(docs, "ServiceAccount", account)
    assert of_kind(docs, "ClusterRole") == []


def test_no_router_leaves_the_replicas_behind_their_service():
    docs = render(**{"router.type": "none"})
    assert router_kinds(docs) == set()
    assert pods(docs)


@pytest.fixture(scope="module")
def llm_d() -> list[dict]:
    return render(PROFILES / "llm-d.yaml", workload="LeaderWorkerSet")


def test_llm_d_pool_holds_the_serving_pods_at_the_gateway_port(llm_d):
    pool = one(llm_d, "InferencePool", FULLNAME)["spec"]
    for pod in pod_templates(llm_d):
        selected = pool["selector"]["matchLabels"].items() <= pod.labels.items()
        assert selected == (pod.origin in ("Deployment", "leader")), pod.origin
        if selected:
            _, gateway = command_line(pod.container("gateway"), group_size=2)
            assert pool["targetPorts"] == [{"number": gateway.port}]  # the OpenAI API and its /metrics
    assert router_kinds(llm_d) == set()  # no SMG beside it


def test_llm_d_endpoint_picker_serves_the_pool_the_route_sends_to(llm_d):
    pool = one(llm_d, "InferencePool", FULLNAME)
    picker = one(llm_d, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["spec"]
    [container] = picker["containers"]
    args = dict(zip(container["args"][::2], container["args"][1::2]))
    assert (args["--pool-name"], args["--pool-namespace"], args["--pool-group"]) == (
        FULLNAME, NAMESPACE, "inference.networking.k8s.io")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(llm_d, "Service", ref["name"])
    [port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == int(args["--grpc-port"])
    assert service["spec"]["selector"].items() <= one(llm_d, "Deployment", f"{FULLNAME}-epp")["spec"]["template"][
        "metadata"]["labels"].items()
    route = one(llm_d, "HTTPRoute", FULLNAME)["spec"]
    assert route["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    assert route["parentRefs"][0]["name"] == "inference-gateway"
    role = one(llm_d, "Role", f"{FULLNAME}-epp")
    readable = {(group, resource) for rule in role["rules"] for group in rule["apiGroups"]
                for resource in rule["resources"] if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= readable


def test_llm_d_reads_nanoserve_metrics_through_the_shipped_engine_config(llm_d):
    picker = one(llm_d, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["spec"]
    [container] = picker["containers"]
    config_file = container["args"][container["args"].index("--config-file") + 1]
    [mount] = [m for m in container["volumeMounts"] if config_file.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in picker["volumes"] if v["name"] == mount["name"]]
    config_map = one(llm_d, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_file.rsplit("/", 1)[1]])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin["type"]: plugin for plugin in config["plugins"]}
    shipped = yaml.safe_load((REPO / "deploy" / "llm-d" / "nanoserve-engine.yaml").read_text())
    assert plugins["core-metrics-extractor"] == shipped
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    parameters = shipped["parameters"]
    [engine] = [e for e in parameters["engineConfigs"] if e["name"] == "nanoserve"]
    for pod in pods(llm_d):
        assert pod.labels[parameters["engineLabelKey"]] == engine["name"]
    referenced = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert referenced <= set(plugins)


def test_crd_schemas_refuse_broken_pools_and_routes(llm_d):
    pool = one(llm_d, "InferencePool", FULLNAME)
    route = one(llm_d, "HTTPRoute", FULLNAME)
    spec = pool["spec"]
    broken_pools = [{key: value for key, value in spec.items() if key != "selector"},
                    {**spec, "targetPorts": []},
                    {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "FailSometimes"}},
                    {**spec, "targetPorts": [{"number": 70000}]}]
    for bad in broken_pools:
        assert schema_errors({**pool, "spec": bad}, "1.37.0"), bad
    rule = route["spec"]["rules"][0]
    broken_routes = [{**rule, "backendRefs": [{**rule["backendRefs"][0], "weight": "heavy"}]},
                     {**rule, "matches": [{"path": {"type": "Prefix", "value": "/"}}]},
                     {**rule, "backend": rule["backendRefs"]}]
    for bad in broken_routes:
        assert schema_errors({**route, "spec": {**route["spec"], "rules": [bad]}}, "1.37.0"), bad
    assert schema_errors(pool, "1.37.0") == schema_errors(route, "1.37.0") == ""
