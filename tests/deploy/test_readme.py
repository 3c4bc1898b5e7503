"""The README tells the truth about the tree: its flag table is the one `python -m nanoserve.flags
--markdown` prints, and every repo path it (or a bench script) names exists."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.processes import ENV

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BEGIN, END = "<!-- flags: begin -->", "<!-- flags: end -->"
# a relative path with at least one folder, e.g. `bench/throughput.py`, `tests/gpu/`, `proto/nanoserve/v1/*.proto`
PATH = re.compile(r"^[\w.*-]+(?:/[\w.*-]*)+$")
TOP_FOLDERS = ("tests", "bench", "docker", "examples", "proto", "nanoserve_kernels", "nanoserve_model", "worker_svc",
               "scheduler_svc", "gateway_svc", "nanoserve_cli")
GENERATED = ("bench/out", "tests/services/node/node_modules")  # written by runs and installs, not committed


def readme_flag_table(text: str) -> str:
    assert BEGIN in text and END in text, f"README.md lost its {BEGIN} ... {END} markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def backticked_paths(markdown: str) -> list[str]:
    """Repo paths written in `backticks` outside fenced code blocks (container paths, starting
    with /, and local state, starting with ., are not the repo's)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    words = [word for span in re.findall(r"`([^`\n]+)`", prose) for word in span.split()]
    return [word for word in words if PATH.match(word) and not word.startswith(".")
            and (word.split("/")[0] in TOP_FOLDERS or Path(word).suffix)]


def script_paths(text: str) -> list[str]:
    """Repo paths a script names: words that start with one of the product or project folders."""
    pattern = rf"(?<![\w/.$-])(?:{'|'.join(TOP_FOLDERS)})/[\w./*-]*"
    return [path for path in re.findall(pattern, text) if not path.startswith(GENERATED)]


def missing(paths: list[str], repo: Path = REPO) -> list[str]:
    return sorted({path for path in paths if not any(repo.glob(path.rstrip("/")))})


def test_readme_flag_table_is_the_generated_one():
    generated = subprocess.run([sys.executable, "-m", "nanoserve.flags", "--markdown"], env=ENV,
                               capture_output=True, text=True, timeout=60, check=True).stdout
    assert readme_flag_table(README.read_text()) == generated, \
        "README.md's flag table is stale: paste `python -m nanoserve.flags --markdown` between its markers"


def test_every_backticked_repo_path_in_the_readme_exists():
    paths = backticked_paths(README.read_text())
    assert {"bench/RESULTS.md", "examples/grpcurl.md", "tests/gpu/"} <= set(paths)  # the reader sees them
    assert missing(paths) == []


@pytest.mark.parametrize("script", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench").glob("*")
                                          if p.suffix in (".py", ".sh")))
def test_every_repo_path_a_bench_script_names_exists(script):
    assert missing(script_paths((REPO / script).read_text())) == []


def test_the_path_checks_catch_a_path_that_is_gone():
    text = ("See `bench/RESULTS.md`, `tests/test_compose.py` and `proto/nanoserve/v1/*.proto`;\n"
            "run `python3 bench/nothing.py --fast`; mount `/model`, read `config.json`, image `nvidia/cuda`.\n"
            "```sh\ncat tests/also_gone.py\n```\n")
    assert backticked_paths(text) == ["bench/RESULTS.md", "tests/test_compose.py", "proto/nanoserve/v1/*.proto",
                                      "bench/nothing.py"]
    assert missing(backticked_paths(text)) == ["bench/nothing.py", "tests/test_compose.py"]
    script = "pytest tests/services/test_integration.py tests/test_integration.py > bench/out/x.log"
    assert missing(script_paths(script)) == ["tests/test_integration.py"]
