"""The README and docs/ tell the truth about the tree: the flag table is the one `python -m
nanoserve.flags --markdown` prints; every repo path they (or a bench script) name exists; every
relative link leads to a file and heading that exist; every `nanoserve ...` command they show parses
with the CLI's own parser, every `make` target is the Makefile's, every `python -m` module and
`python3 bench/...` script exists, every image is built under the name compose gives it."""
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve_cli.cli import build_parser
from tests.deploy.compose_model import raw_services
from tests.services.processes import ENV

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIGURATION = REPO / "docs" / "configuration.md"
BEGIN, END = "<!-- flags: begin -->", "<!-- flags: end -->"
# a relative path with at least one folder, e.g. `bench/throughput.py`, `tests/gpu/`, `proto/nanoserve/v1/*.proto`
PATH = re.compile(r"^[\w.*-]+(?:/[\w.*-]*)+$")
# (not deploy/: in a code block `deploy/NAME` is as often kubectl's name of a Deployment)
TOP_FOLDERS = ("tests", "bench", "docker", "docs", "examples", "proto", "nanoserve_kernels", "nanoserve_model",
               "worker_svc", "scheduler_svc", "gateway_svc", "nanoserve_cli")
GENERATED = ("bench/out", "tests/services/node/node_modules")  # written by runs and installs, not committed
FENCED = re.compile(r"^ *```([^\n]*)\n(.*?)^ *```", flags=re.S | re.M)  # indented too: a block in a list item
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}


def doc_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def flag_table(text: str) -> str:
    assert BEGIN in text and END in text, f"lost its {BEGIN} ... {END} markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def backticked_paths(markdown: str) -> list[str]:
    """Repo paths written in `backticks` outside fenced code blocks (container paths, starting
    with /, and local state, starting with ., are not the repo's)."""
    prose = FENCED.sub("", markdown)
    words = [word for span in re.findall(r"`([^`\n]+)`", prose) for word in span.split()]
    return [word for word in words if PATH.match(word) and not word.startswith(".")
            and (word.split("/")[0] in TOP_FOLDERS or Path(word).suffix)]


def script_paths(text: str) -> list[str]:
    """Repo paths a script (or a code block) names: words that start with one of the project's folders."""
    pattern = rf"(?<![\w/.$-])(?:{'|'.join(TOP_FOLDERS)})/[\w./*-]*"
    paths = [path.rstrip(".") for path in re.findall(pattern, text)]  # a sentence's full stop is not the path's
    return [path for path in paths if not path.startswith(GENERATED)]


def missing(paths: list[str], repo: Path = REPO) -> list[str]:
    return sorted({path for path in paths if not any(repo.glob(path.rstrip("/")))})


def shell_commands(markdown: str) -> list[list[str]]:
    """Each simple command of the fenced code blocks (lines joined at a trailing backslash, comments
    dropped, split at pipes, `&&` and `;`), as its words. Python blocks are not shell."""
    commands = []
    for block in FENCED.finditer(markdown):
        if block[1].startswith("python"):
            continue
        for line in block[2].replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (an ASCII picture)
                continue
            command: list[str] = []
            for word in words + [";"]:
                if word in SHELL_OPERATORS:
                    commands += [command] if command else []
                    command = []
                else:
                    command.append(word)
    return commands


def command_problems(words: list[str], make_targets: set[str]) -> list[str]:
    """Why a shown command would not run as shown ([] when it would, or is not ours to check)."""
    for start, word in enumerate(words):
        if word == "nanoserve" or word.endswith("/bin/nanoserve"):
            try:  # "..." stands for flags the page leaves out
                build_parser().parse_args([w for w in words[start + 1:] if w != "..."])
            except SystemExit as stop:
                return [] if stop.code == 0 else [f"`{shlex.join(words[start:])}` does not parse"]
            return []
    if words[0] == "make":
        return [f"make has no target {t}" for t in words[1:] if "=" not in t and not t.startswith("-")
                and t not in make_targets]
    if Path(words[0]).name.startswith("python") and len(words) > 1:
        if words[1] == "-m" and importlib.util.find_spec(words[2]) is None:
            return [f"no module {words[2]}"]
        if words[1].endswith(".py") and not (REPO / words[1]).exists():
            return [f"no script {words[1]}"]
    return []


def makefile_targets(makefile: Path = REPO / "Makefile") -> set[str]:
    return set(re.findall(r"^([\w.-]+):", makefile.read_text(), flags=re.M))


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: a heading lower-cased, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", markdown), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(doc: Path) -> list[str]:
    """Relative links [text](target#anchor) whose file or heading does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_flag_table_in_the_docs_is_the_generated_one():
    generated = subprocess.run([sys.executable, "-m", "nanoserve.flags", "--markdown"], env=ENV,
                               capture_output=True, text=True, timeout=60, check=True).stdout
    assert flag_table(CONFIGURATION.read_text()) == generated, \
        "docs/configuration.md's flag table is stale: paste `python -m nanoserve.flags --markdown` between its markers"


def test_the_docs_have_their_parts_and_the_readme_stays_short():
    assert {"README.md", "architecture.md", "configuration.md", "api.md", "deployment.md", "benchmarks.md"} <= \
        {path.name for path in DOCS if path.parent.name == "docs"}
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    index = (REPO / "docs" / "README.md").read_text()
    unlisted = [path.name for path in DOCS if path.parent.name == "docs" and path.name != "README.md"
                and f"]({path.name})" not in index]
    assert unlisted == [], "docs/README.md does not link these pages"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_repo_path_a_doc_names_exists(doc):
    text = doc.read_text()
    code = "\n".join(block[2] for block in FENCED.finditer(text))
    assert missing(backticked_paths(text) + script_paths(code)) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_of_a_doc_leads_somewhere(doc):
    assert broken_links(doc) == []
    assert "DESIGN" not in doc.read_text()  # a design document the reader does not have: link docs/ instead


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_command_a_doc_shows_parses(doc):
    targets = makefile_targets()
    assert [problem for words in shell_commands(doc.read_text()) for problem in command_problems(words, targets)] == []


def built_images(markdown: str) -> dict[str, str]:
    """Dockerfile -> image name (no registry, no tag) of each `docker build -f FILE -t NAME` a page shows."""
    return {words[words.index("-f") + 1]: words[words.index("-t") + 1].rsplit("/", 1)[-1].split(":")[0]
            for words in shell_commands(markdown) if words[:2] == ["docker", "build"]}


def test_the_docs_build_every_image_under_its_compose_name():
    """The Kubernetes page builds and pushes every image docker/ holds (the chart pulls them all), and
    every page names each image as compose.yaml does."""
    compose = {service["build"]["dockerfile"]: service["image"] for service in raw_services().values()
               if "build" in service}
    assert set(compose) == {path.relative_to(REPO).as_posix() for path in (REPO / "docker").glob("*.Dockerfile")}
    assert built_images((REPO / "docs" / "kubernetes.md").read_text()) == compose
    for doc in DOCS:
        assert built_images(doc.read_text()).items() <= compose.items(), doc_id(doc)


def test_the_readme_shows_the_commands_a_user_starts_with():
    commands = [shlex.join(words) for words in shell_commands((REPO / "README.md").read_text())]
    assert {"make serve", "make test", "nanoserve up --model Qwen/Qwen3-8B --openai-port 8000", "nanoserve info",
            "pip install -r docker/requirements-worker.txt"} <= set(commands)


@pytest.mark.parametrize("script", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench").glob("*")
                                          if p.suffix in (".py", ".sh")))
def test_every_repo_path_a_bench_script_names_exists(script):
    assert missing(script_paths((REPO / script).read_text())) == []


def test_the_checks_catch_what_is_gone(tmp_path):
    text = ("See `bench/RESULTS.md`, `tests/test_compose.py` and `proto/nanoserve/v1/*.proto`;\n"
            "run `python3 bench/nothing.py --fast`; mount `/model`, read `config.json`, image `nvidia/cuda`.\n"
            "```sh\ncat tests/also_gone.py\n```\n")
    assert backticked_paths(text) == ["bench/RESULTS.md", "tests/test_compose.py", "proto/nanoserve/v1/*.proto",
                                      "bench/nothing.py"]
    assert missing(backticked_paths(text)) == ["bench/nothing.py", "tests/test_compose.py"]
    script = "pytest tests/services/test_integration.py tests/test_integration.py > bench/out/x.log; see tests/gpu/."
    assert missing(script_paths(script)) == ["tests/test_integration.py"]

    shown = ("```sh\nnanoserve up --model M --no-such-flag && make serve PORT=1\n"
             "docker compose exec scheduler nanoserve generate hi --max-tokens 3  # fine\n"
             "make nothing\npython -m no_such_module\npython3 bench/gone.py \\\n  --fast\n```\n")
    problems = [p for words in shell_commands(shown) for p in command_problems(words, {"serve"})]
    assert problems == ["`nanoserve up --model M --no-such-flag` does not parse", "make has no target nothing",
                        "no module no_such_module", "no script bench/gone.py"]
    in_a_list = "- Build:\n\n  ```bash\n  docker build -f docker/x.Dockerfile -t registry.example.com/x:0.1.0 .\n  ```\n"
    assert built_images(in_a_list) == {"docker/x.Dockerfile": "x"}

    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Its part (one)\n\n[ok](#its-part-one) [bad](#nowhere) [gone](other.md) "
                    "[web](https://example.com)\n")
    assert broken_links(page) == ["#nowhere (no such heading)", "other.md (no such file)"]
