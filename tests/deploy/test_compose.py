"""compose.yaml: valid for a real Compose implementation, and the deployment contract holds on the
model it resolves (run once per implementation found: Docker's plugin, Debian's docker-compose)."""
import os
import sys
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from nanoserve import flags
from nanoserve_cli.router import router_command
from tests.deploy.compose_model import (REPO, Deployment, cli_args, compose_clis, compose_config, deployments,
                                        is_nanoserve, resolved_model)
from tests.deploy.dockerfile_model import entrypoint

CLIS = compose_clis()
MODEL_DIR = "/srv/models"
MODEL = "Qwen/Qwen3-0.6B"  # the default the download fetches and the workers load
NO_COMPOSE = ("no Compose implementation to validate compose.yaml with: "
              "`apt-get install docker-compose` (Debian) or Docker's compose plugin")
HEALTHCHECK = ["CMD", "python", "-m", "nanoserve.healthcheck", "--address"]
GATEWAY_HEALTHCHECK = ["CMD", "python", "-m", "gateway_svc.healthcheck"]
TOOLS = {"download", "prometheus", "dp2-router"}  # the services that run no `nanoserve` command
SHUTDOWN_TIMEOUT = flags.defaults("scheduler")["shutdown_timeout"]


@pytest.fixture(scope="module", params=CLIS or [None], ids=lambda cli: " ".join(cli) if cli else "none")
def cli(request) -> list[str]:
    if request.param is None:
        if os.environ.get("CI"):  # CI must prove the file valid; a developer machine may lack Compose
            pytest.fail(NO_COMPOSE)
        pytest.skip(NO_COMPOSE)
    return request.param


@pytest.fixture(scope="module")
def model(cli) -> dict:
    return resolved_model(cli, {})


@pytest.fixture(scope="module")
def services(model) -> dict[str, dict]:
    return model["services"]


@pytest.fixture(scope="module")
def groups(services) -> list[Deployment]:
    return deployments(services)


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume, from the short or the long syntax."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            out.append((source, target, mode == ["ro"]))
        else:
            out.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return out


def published(service: dict) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port; "" = every address."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, str):  # docker-compose 1.x keeps the short form when it names an address
            *host, target = port.split("/")[0].split(":")
            out.append((host[0] if len(host) == 2 else "", int(host[-1]), int(target)))
        else:
            out.append((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
    return out


def networks_of(service: dict) -> dict[str, list[str]]:
    """network -> the aliases the service has there."""
    nets = service.get("networks", {})
    return {name: list((nets[name] or {}).get("aliases", [])) if isinstance(nets, dict) else [] for name in nets}


def test_compose_file_is_valid(cli):
    for variables in ({}, {"MODEL_DIR": MODEL_DIR, "MODEL": "Qwen3-0.6B"}):
        result = compose_config(cli, variables)
        assert result.returncode == 0, result.stderr


def test_every_service_is_a_scheduler_its_workers_its_gateway_or_a_tool(services, groups):
    workers = [w for g in groups for w in g.workers]
    assert len(workers) == len(set(workers)), "a worker serves two schedulers"
    assert all(len(g.gateways) == 1 for g in groups), groups
    assert set(services) == {g.scheduler for g in groups} | set(workers) | {gw for g in groups for gw in g.gateways} \
        | TOOLS
    assert not any(is_nanoserve(services[name]) for name in TOOLS)


def test_default_is_one_rank_tp2_two_ranks_and_dp2_two_replicas_of_one(services, groups):
    by_profile = {tuple(services[g.scheduler].get("profiles", [])): len(g.workers) for g in groups}
    assert by_profile == {(): 1, ("tp2",): 2, ("dp2",): 1}
    assert sum(services[g.scheduler].get("profiles") == ["dp2"] for g in groups) == 2
    for g in groups:
        profiles = services[g.scheduler].get("profiles", [])
        assert all(services[s].get("profiles", []) == profiles for s in g.workers + g.gateways)
    assert services["download"]["profiles"] == ["download"] and services["prometheus"]["profiles"] == ["metrics"]


def test_ranks_and_tensor_parallel_size_agree(services, groups):
    for g in groups:
        scheduler = cli_args(g.scheduler, services[g.scheduler])
        for rank, name in enumerate(g.workers):
            args = cli_args(name, services[name])
            assert args.command == "worker"
            assert (args.rank, args.tensor_parallel_size) == (rank, len(g.workers)), name
            assert scheduler.workers.split(",")[rank] == f"{name}:{args.port}"
            if len(g.workers) > 1:  # the ranks meet at rank 0's torch.distributed store
                assert args.dist_init_addr.split(":")[0] == g.workers[0], name
            limits = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
            assert [getattr(args, k) for k in limits] == [getattr(scheduler, k) for k in limits], name


def test_services_listen_on_every_address_of_their_container(services):
    """The services bind loopback unless told otherwise; in a container that would reach nobody."""
    for name, service in services.items():
        if is_nanoserve(service):
            assert "--host" in service["command"], f"{name} must pass --host explicitly"
            assert cli_args(name, service).host == "0.0.0.0", name


def test_the_gateway_is_the_only_http_port_published_beside_the_grpc_api(services, groups):
    """Each deployment publishes one HTTP port (its gateway, or dp2's router) and its schedulers' gRPC API."""
    replica_ports = []
    for g in groups:
        (gateway,) = g.gateways
        scheduler_port = cli_args(g.scheduler, services[g.scheduler]).port
        for name in g.workers:
            assert "ports" not in services[name], f"{name} must not be published"
            assert str(cli_args(name, services[name]).port) in services[name]["expose"]
        if services[g.scheduler].get("profiles") == ["dp2"]:  # the router is the HTTP door
            assert published(services[gateway]) == []
            [(address, host_port, port)] = published(services[g.scheduler])
            assert (address, port) == ("", scheduler_port)
            replica_ports.append(host_port)
            continue
        assert published(services[gateway]) == [("", 8000, cli_args(gateway, services[gateway]).port)]
        assert published(services[g.scheduler]) == [("", 50051, scheduler_port)]
    assert sorted(replica_ports) == [50051, 50052]
    assert published(services["dp2-router"]) == [("", 8000, 8000)]
    assert published(services["prometheus"]) == [("127.0.0.1", 9090, 9090)]  # the operator's, on loopback
    assert "ports" not in services["download"]


def test_workers_are_reachable_on_the_internal_network_alone(model, services, groups):
    internal = {name for name, net in model["networks"].items() if (net or {}).get("internal")}
    for g in groups:
        scheduler_networks = set(networks_of(services[g.scheduler]))
        assert scheduler_networks & internal and scheduler_networks - internal
        for name in g.workers:
            assert set(networks_of(services[name])) <= internal & scheduler_networks, name
        for name in g.gateways:  # reaches its scheduler, and is reached from outside
            assert set(networks_of(services[name])) <= scheduler_networks - internal, name


def test_every_worker_reserves_its_own_gpu(services, groups):
    dp2 = [services[w]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for g in groups
           for w in g.workers if services[w].get("profiles") == ["dp2"]]
    assert len(dp2) == 2 and dp2[0] != dp2[1], dp2  # the replicas, a GPU each
    for g in groups:
        device_ids = []
        for name in g.workers:
            (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia", name
            device_ids += device["device_ids"]
        assert len(device_ids) == len(g.workers) == len(set(device_ids)), device_ids
        assert not any("deploy" in services[name] for name in (g.scheduler, *g.gateways))


def test_ranks_can_share_memory_for_nccl(services, groups):
    for name in (w for g in groups for w in g.workers):
        assert services[name].get("ipc") == "host" or services[name].get("shm_size"), name
        assert str(services[name]["environment"]["NCCL_NVLS_ENABLE"]) == "0", name


def test_health_checks_probe_each_service_port(services):
    for name, service in services.items():
        if not is_nanoserve(service):
            continue
        check, args = service["healthcheck"]["test"], cli_args(name, service)
        if args.command == "gateway":  # the probe takes the gateway's own flags
            assert check[:4] == GATEWAY_HEALTHCHECK, name
            assert flags.parse("gateway", check[4:]).port == args.port, name
        else:
            assert check[:-1] == HEALTHCHECK, name
            assert check[-1] == f"127.0.0.1:{args.port}", name


def test_each_service_starts_once_what_it_needs_is_healthy(services, groups):
    for g in groups:
        depends_on = services[g.scheduler]["depends_on"]
        assert {name: dep["condition"] for name, dep in depends_on.items()} == \
            {name: "service_healthy" for name in g.workers}
        for gateway in g.gateways:
            assert {name: dep["condition"] for name, dep in services[gateway]["depends_on"].items()} == \
                {g.scheduler: "service_healthy"}
            port = cli_args(g.scheduler, services[g.scheduler]).port
            assert cli_args(gateway, services[gateway]).scheduler == f"{g.scheduler}:{port}"


@pytest.mark.parametrize("variables, source, model_path", [
    ({}, "models", f"/models/{MODEL}"),  # the named volume the download fills
    ({"MODEL_DIR": MODEL_DIR, "MODEL": "Qwen3-8B"}, MODEL_DIR, "/models/Qwen3-8B"),  # a host folder instead
])
def test_the_model_is_mounted_read_only_where_every_service_looks(cli, variables, source, model_path):
    services = resolved_model(cli, variables)["services"]
    for g in deployments(services):
        for name in (g.scheduler, *g.workers, *g.gateways):
            assert (source, "/models", True) in mounts(services[name]), name
        assert all(cli_args(w, services[w]).model == model_path for w in g.workers)
        assert all(cli_args(gw, services[gw]).served_model_name == variables.get("MODEL", MODEL)
                   for gw in g.gateways)  # clients ask for the model by the name they know
    download = services["download"]
    assert (source, "/models", False) in mounts(download)
    assert download["command"] == [variables.get("MODEL", MODEL), "--local-dir", model_path]


def test_the_download_is_huggingface_hubs_own_command_in_the_worker_image(services, tmp_path):
    download = services["download"]
    assert download["entrypoint"] == ["hf", "download"] and download["image"] == services["worker"]["image"]
    assert download["build"] == services["worker"]["build"]
    assert "hf download --help" in (REPO / "docker/worker.Dockerfile").read_text()  # the image checks it has it
    hf = shutil.which("hf", path=str(Path(sys.executable).parent))
    assert hf, "huggingface_hub's `hf` command is missing from this environment"
    repo_id, option, local_dir = download["command"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([hf, "download", repo_id, option, str(tmp_path / local_dir.lstrip("/"))], env=env,
                            capture_output=True, text=True, timeout=60)
    # Offline, the command parses and gets as far as asking the Hub (a usage error would exit 2).
    assert result.returncode == 1 and "offline" in result.stdout + result.stderr, result.stdout + result.stderr


def test_long_running_services_restart(services):
    assert {name: s.get("restart") for name, s in services.items() if name != "download"} == \
        {name: "unless-stopped" for name in services if name != "download"}
    assert services["download"].get("restart", "no") == "no"


def test_prometheus_scrapes_every_deployments_scheduler_and_gateway(services, groups):
    """By a DNS name that every deployment's scheduler (gateway) answers to: all of dp2's replicas too."""
    config_file, target = services["prometheus"]["volumes"][0].split(":")[:2]
    assert target == "/etc/prometheus/prometheus.yml"
    config = yaml.safe_load(Path(config_file).read_text())
    scraped = {job["job_name"]: (name, sd["port"]) for job in config["scrape_configs"] for sd in job["dns_sd_configs"]
               for name in sd["names"]}
    prometheus_networks = set(networks_of(services["prometheus"]))
    for g in groups:
        expected = {"nanoserve-scheduler": (g.scheduler, cli_args(g.scheduler, services[g.scheduler]).metrics_port),
                    "nanoserve-gateway": (g.gateways[0], cli_args(g.gateways[0], services[g.gateways[0]]).port)}
        for job, (name, port) in expected.items():
            host, scraped_port = scraped[job]
            assert int(scraped_port) == port != 0, (job, name)
            reachable = [net for net, aliases in networks_of(services[name]).items()
                         if net in prometheus_networks and host in (name, *aliases)]
            assert reachable, f"Prometheus cannot reach {name} as {host}"


def test_the_dp2_router_is_smg_as_up_runs_it(services, groups):
    """The router image's entrypoint and the command are the command line `nanoserve up
    --data-parallel-size 2` runs SMG with (SMG's launcher, its accept queue deepened), which SMG's own
    parser takes; its backends are the dp2 gateways, and it starts once they serve."""
    launch_router = pytest.importorskip("smg.launch_router", reason="SMG's parser comes with `pip install smg`")
    router = services["dp2-router"]
    assert router["image"] == "nanoserve-router" and router["build"]["dockerfile"] == "docker/router.Dockerfile"
    args = launch_router.parse_router_args([str(arg) for arg in router["command"]])
    args._validate_router_args()
    gateways = [gw for g in groups if services[g.scheduler].get("profiles") == ["dp2"] for gw in g.gateways]
    urls = [f"http://{gw}:{cli_args(gw, services[gw]).port}" for gw in sorted(gateways)]
    assert args.worker_urls == urls
    up = Namespace(host="0.0.0.0", openai_port=8000, router_policy="cache_aware", shutdown_timeout=SHUTDOWN_TIMEOUT,
                   max_num_seqs=flags.defaults("up")["max_num_seqs"])
    container = [*entrypoint(REPO / router["build"]["dockerfile"]), *map(str, router["command"])]
    assert container == ["python", *router_command(up, urls, args.prometheus_port)[1:]]
    assert {name: dep["condition"] for name, dep in router["depends_on"].items()} == \
        {gw: "service_healthy" for gw in gateways}


def test_services_that_drain_get_the_time_to(services):
    """Compose kills a container 10 s after SIGTERM unless told otherwise: the scheduler, gateway and
    router drain for up to --shutdown-timeout, so they are given longer."""
    for name, service in services.items():
        if name in ("dp2-router",) or (is_nanoserve(service) and service["command"][0] in ("scheduler", "gateway")):
            grace = service["stop_grace_period"]
            assert grace.endswith("s") and float(grace[:-1]) > SHUTDOWN_TIMEOUT + 5, (name, grace)
