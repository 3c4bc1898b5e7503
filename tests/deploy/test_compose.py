"""compose.yaml: valid for a real Compose implementation, and the deployment contract holds on the
model it resolves (run once per implementation found: Docker's plugin, Debian's docker-compose)."""
import os

import pytest

from tests.deploy.compose_model import (Deployment, cli_args, compose_clis, compose_config, deployments,
                                  resolved_model)

CLIS = compose_clis()
MODEL_DIR = "/srv/models/Qwen3-0.6B"
NO_COMPOSE = ("no Compose implementation to validate compose.yaml with: "
              "`apt-get install docker-compose` (Debian) or Docker's compose plugin")
HEALTHCHECK = ["CMD", "python", "-m", "nanoserve.healthcheck", "--address"]


@pytest.fixture(scope="module", params=CLIS or [None], ids=lambda cli: " ".join(cli) if cli else "none")
def cli(request) -> list[str]:
    if request.param is None:
        if os.environ.get("CI"):  # CI must prove the file valid; a developer machine may lack Compose
            pytest.fail(NO_COMPOSE)
        pytest.skip(NO_COMPOSE)
    return request.param


@pytest.fixture(scope="module")
def model(cli) -> dict:
    return resolved_model(cli, {"MODEL_DIR": MODEL_DIR})


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


def test_compose_file_is_valid(cli):
    result = compose_config(cli, {"MODEL_DIR": MODEL_DIR})
    assert result.returncode == 0, result.stderr


def test_model_dir_is_required(cli):
    result = compose_config(cli, {})
    assert result.returncode != 0
    assert "MODEL_DIR" in result.stderr


def test_every_service_is_a_scheduler_or_one_of_its_workers(services, groups):
    workers = [w for g in groups for w in g.workers]
    assert len(workers) == len(set(workers)), "a worker serves two schedulers"
    assert set(services) == {g.scheduler for g in groups} | set(workers)


def test_default_is_two_ranks_and_a_profile_runs_one(services, groups):
    by_profile = {tuple(services[g.scheduler].get("profiles", [])): len(g.workers) for g in groups}
    assert by_profile == {(): 2, ("one-rank",): 1}
    for g in groups:
        profiles = services[g.scheduler].get("profiles", [])
        assert all(services[w].get("profiles", []) == profiles for w in g.workers)


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


def test_only_schedulers_publish_their_port(services, groups):
    for g in groups:
        port = cli_args(g.scheduler, services[g.scheduler]).port
        published = [(int(p["published"]), int(p["target"])) for p in services[g.scheduler]["ports"]]
        assert published == [(50051, port)]
        for name in g.workers:
            assert "ports" not in services[name], f"{name} must not be published"
            assert str(cli_args(name, services[name]).port) in services[name]["expose"]


def test_workers_are_reachable_on_the_internal_network_alone(model, services, groups):
    internal = {name for name, net in model["networks"].items() if (net or {}).get("internal")}
    for g in groups:
        scheduler_networks = set(services[g.scheduler]["networks"])
        assert scheduler_networks & internal and scheduler_networks - internal
        for name in g.workers:
            assert set(services[name]["networks"]) <= internal & scheduler_networks, name


def test_every_worker_reserves_its_own_gpu(services, groups):
    for g in groups:
        device_ids = []
        for name in g.workers:
            (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia", name
            device_ids += device["device_ids"]
        assert len(device_ids) == len(g.workers) == len(set(device_ids)), device_ids


def test_ranks_can_share_memory_for_nccl(services, groups):
    for name in (w for g in groups for w in g.workers):
        assert services[name].get("ipc") == "host" or services[name].get("shm_size"), name
        assert str(services[name]["environment"]["NCCL_NVLS_ENABLE"]) == "0", name


def test_health_checks_probe_each_service_port(services):
    for name, service in services.items():
        check = service["healthcheck"]["test"]
        assert check[:-1] == HEALTHCHECK, name
        assert check[-1] == f"127.0.0.1:{cli_args(name, service).port}", name


def test_scheduler_starts_after_every_worker_is_healthy(services, groups):
    for g in groups:
        depends_on = services[g.scheduler]["depends_on"]
        assert {name: dep["condition"] for name, dep in depends_on.items()} == \
            {name: "service_healthy" for name in g.workers}


def test_model_dir_is_mounted_read_only_where_the_workers_look(services, groups):
    for g in groups:
        for name in (g.scheduler, *g.workers):
            assert (MODEL_DIR, "/model", True) in mounts(services[name]), name
        assert all(cli_args(w, services[w]).model == "/model" for w in g.workers)


def test_every_service_restarts(services):
    assert {name: s.get("restart") for name, s in services.items()} == \
        {name: "unless-stopped" for name in services}
