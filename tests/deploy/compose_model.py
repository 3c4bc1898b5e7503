"""compose.yaml as the tests read it: resolved by a real Compose implementation, and each
nanoserve service's command line parsed by the CLI's own argument parser."""
import argparse
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

from nanoserve_cli.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
PROFILES = ("tp2", "dp2", "metrics", "download")


def compose_clis() -> list[list[str]]:
    """The Compose implementations on this machine: Docker's plugin and Debian's docker-compose."""
    found = []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


def compose_config(cli: list[str], variables: dict[str, str]) -> subprocess.CompletedProcess:
    """`config` over compose.yaml with every profile on, seeing only `variables` (no shell
    variables, no .env file)."""
    profiles = [arg for name in PROFILES for arg in ("--profile", name)]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **variables}
    with tempfile.NamedTemporaryFile(suffix=".env") as no_env_file:
        return subprocess.run([*cli, "--project-directory", str(REPO), "--env-file", no_env_file.name,
                               "-f", str(COMPOSE_FILE), *profiles, "config"],
                              env=env, capture_output=True, text=True, timeout=60)


def resolved_model(cli: list[str], variables: dict[str, str]) -> dict:
    """The project as the implementation resolves it (anchors merged, variables substituted)."""
    result = compose_config(cli, variables)
    assert result.returncode == 0, f"{' '.join(cli)} config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def raw_services() -> dict[str, dict]:
    """The services as written (YAML anchors merged), each ${VAR:-default} taken at its default."""
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", COMPOSE_FILE.read_text())
    assert "${" not in text, "a compose variable without a default"
    return yaml.safe_load(text)["services"]


CLI_IMAGES = ("nanoserve-scheduler", "nanoserve-worker")  # the project's images whose entrypoint is `nanoserve`


def is_nanoserve(service: dict) -> bool:
    """A service running `nanoserve COMMAND` from one of the project's images (not a one-shot tool, not
    the router, whose image runs SMG's launcher)."""
    return service.get("image") in CLI_IMAGES and "entrypoint" not in service


def cli_args(name: str, service: dict) -> argparse.Namespace:
    """The service's command parsed by nanoserve's parser, which reads NANOSERVE_* as defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    command = [str(arg) for arg in service["command"]]
    with mock.patch.dict(os.environ, env, clear=True):
        try:
            return build_parser().parse_args(command)
        except SystemExit:
            raise AssertionError(f"{name}: `nanoserve {' '.join(command)}` does not parse") from None


@dataclass
class Deployment:
    """One scheduler service, the worker services it drives (in rank order) and the gateways in
    front of it."""
    scheduler: str
    workers: list[str]
    gateways: list[str]


def deployments(services: dict[str, dict]) -> list[Deployment]:
    """Every scheduler service, with its workers named by the hosts in its --workers list and the
    gateways whose --scheduler names it."""
    commands = {name: cli_args(name, service) for name, service in services.items() if is_nanoserve(service)}
    return [Deployment(name, [addr.split(":")[0] for addr in args.workers.split(",")],
                       [gw for gw, gw_args in commands.items()
                        if gw_args.command == "gateway" and gw_args.scheduler.split(":")[0] == name])
            for name, args in commands.items() if args.command == "scheduler"]
