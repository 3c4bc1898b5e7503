"""The chart's routers, on what `helm template` renders: SMG finds exactly the pods that serve the
OpenAI API, with the arguments its own parser accepts and no more rights than listing pods; the llm-d
profile's InferencePool, endpoint picker and HTTPRoute meet each other and nanoserve's pods."""
from importlib import metadata

import pytest

from tests.deploy.chart_model import (FULLNAME, NAMESPACE, PROFILES, command_line, of_kind, one, pod_templates, pods,
                                      render)

ROUTER = f"{FULLNAME}-router"


def router_kinds(docs: list[dict]) -> set[str]:
    return {doc["kind"] for doc in docs if doc["metadata"]["name"].startswith(ROUTER)}


@pytest.mark.parametrize("profile", [None, PROFILES / "multi-host.yaml"], ids=["deployment", "multi-host"])
def test_smg_discovers_the_pods_that_serve_the_openai_api(profile):
    launch_router = pytest.importorskip("smg.launch_router", reason="SMG's parser comes with `pip install smg`")
    docs = render(profile)
    router = one(docs, "Deployment", ROUTER)["spec"]["template"]
    [container] = router["spec"]["containers"]
    args = launch_router.parse_router_args(container["args"])  # SMG's own parser, as its image runs it
    args._validate_router_args()
    # the image runs the SMG release whose parser checked the arguments
    assert container["image"].rsplit(":", 1)[1] == metadata.version("smg")
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    assert args.policy == "cache_aware"
    for pod in pod_templates(docs):
        selected = args.selector.items() <= pod.labels.items()
        assert selected == (pod.origin in ("Deployment", "leader")), pod.origin
        if selected:
            _, gateway = command_line(pod.container("gateway"), group_size=2)
            assert args.service_discovery_port == gateway.port
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (ports["http"], ports["metrics"]) == (args.port, args.prometheus_port)


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
