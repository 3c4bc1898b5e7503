"""What `pip install` gets: the server distribution declares its dependencies (the scheduler's at its
base, the worker's and the gateway's as extras), and the Python client installs on its own
(proto/pyproject.toml) with grpcio and protobuf and none of the server code."""
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def pinned(path: Path) -> set[str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return names([line for line in lines if line and not line.startswith("-r")])


def test_the_server_distribution_declares_what_each_part_imports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base, extras = names(project["dependencies"]), project["optional-dependencies"]
    # the scheduler image runs the scheduler (with its KV events), the CLI and client, and the gateway
    assert base | names(extras["kv-events"]) | names(extras["gateway"]) == pinned(
        REPO / "docker/requirements-scheduler.txt")
    assert {"torch", "safetensors", "numpy"} <= names(extras["worker"])
    assert {"fastapi", "uvicorn", "jinja2"} <= names(extras["gateway"])
    assert base | names(extras["worker"]) | names(extras["gateway"]) | names(extras["kv-events"]) <= pinned(
        REPO / "requirements.txt") | {"torch"}


def test_the_server_installs_only_names_of_its_own():
    """No generic top-level package (`model`, `kernels`) lands in a user's site-packages."""
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p for where in found["where"] for p in find_packages(REPO / where, include=found["include"])}
    tops = {p.split(".")[0] for p in packages}
    assert {"nanoserve", "nanoserve_model", "nanoserve_kernels", "worker_svc", "scheduler_svc"} <= tops
    assert all(top.startswith("nanoserve") or top.endswith("_svc") for top in tops), tops


def files_below(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*")}


def client_wheel(tmp_path: Path) -> Path:
    """`pip wheel ./proto` (what `pip install ./proto` builds), on a copy of proto/, which it must leave
    as it was: no build/ or *.egg-info behind."""
    source = tmp_path / "src"
    shutil.copytree(REPO / "proto", source, ignore=shutil.ignore_patterns("__pycache__"))
    before = files_below(source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    assert files_below(source) == before
    (wheel,) = (tmp_path / "dist").glob("nanoserve_client-*.whl")
    return wheel


def closure(requirements: set[str]) -> set[str]:
    """The installed distributions these need, their dependencies included (extras left out)."""
    todo, seen = list(requirements), set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name not in seen:
            seen.add(name)
            todo += [r.name for r in map(Requirement, metadata.requires(name) or [])
                     if not r.marker or r.marker.evaluate({"extra": ""})]
    return seen


def test_the_client_installs_alone_with_grpcio_and_protobuf(tmp_path: Path):
    wheel = client_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        meta = archive.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        archive.extractall(tmp_path / "site")
    assert {f.split("/")[0] for f in files} == {"nanoserve", wheel.name.split("-py3")[0] + ".dist-info"}
    assert {"nanoserve/v1/llm.proto", "nanoserve/v1/llm_pb2.pyi", "nanoserve/client.py"} <= set(files)
    requires = [line.removeprefix("Requires-Dist: ") for line in meta.splitlines() if line.startswith("Requires-Dist")]
    assert names([r for r in requires if "extra ==" not in r]) == {"grpcio", "protobuf"}

    site = tmp_path / "site"  # the wheel and grpcio + protobuf with their dependencies: nothing else
    for name in closure({"grpcio", "protobuf"}):
        for top in {f.parts[0] for f in metadata.distribution(name).files if f.parts[0] != ".."}:
            if not (site / top).exists():
                (site / top).symlink_to(metadata.distribution(name).locate_file(top))
    check = ("from nanoserve.client import Client; Client('localhost').close(); import importlib.util as u; "
             "assert not any(u.find_spec(m) for m in "
             "('scheduler_svc', 'worker_svc', 'nanoserve_model', 'nanoserve_kernels'))")
    result = subprocess.run([sys.executable, "-S", "-c", check], env={"PYTHONPATH": str(site)}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
