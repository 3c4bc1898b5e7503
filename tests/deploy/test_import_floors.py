"""The product code stands on floors: the contract package `nanoserve` at the bottom, then
`kernels`, then `model`, then the services, then the CLI. Every import of every product file
(top level and inside functions alike), parsed with ast, must point down or sideways within its own
package; the services never import each other, the CLI imports no service, scheduler_svc and
gateway_svc never reach torch, and no product modules import each other in a circle, inside a
service too. Imports under `if TYPE_CHECKING:` never run, so the floor and torch checks skip them;
the circle check counts them: a module that names its user's types still reaches back into it.
A failure names the offending import as file:line."""
import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLOORS = {"nanoserve": 0, "nanoserve_kernels": 1, "nanoserve_model": 2,
          "worker_svc": 3, "scheduler_svc": 3, "gateway_svc": 3, "nanoserve_cli": 4}
SERVICES = {"worker_svc", "scheduler_svc", "gateway_svc"}
NO_TORCH = {"scheduler_svc", "gateway_svc"}
TORCH = {"torch", "triton", "flash_attn"}


@dataclass(frozen=True)
class Import:
    source: str   # the importing module, e.g. "nanoserve_model.attention"
    target: str   # the imported module (a product module, or the top name of a third-party one)
    where: str    # "nanoserve_model/attention.py:7"

    @property
    def file(self) -> str:
        return self.where.rsplit(":", 1)[0]


def package_roots(repo: Path) -> dict[str, Path]:
    """Top-level product package -> its folder (the contract package lives under proto/)."""
    roots = {name: repo / name for name in FLOORS}
    roots["nanoserve"] = repo / "proto" / "nanoserve"
    return {name: path for name, path in roots.items() if path.is_dir()}


def product_modules(repo: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the product packages."""
    modules = {}
    for name, root in package_roots(repo).items():
        for path in sorted(root.rglob("*.py")):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest product module `name` falls in, else its top-level name (a third-party import)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(repo: Path, type_hints: bool = False) -> list[Import]:
    """Every import of the product files; those under `if TYPE_CHECKING:` only with `type_hints`."""
    modules = product_modules(repo)
    found = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        where = path.relative_to(repo).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in type_only and not type_hints:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing package, `level` steps up
                    package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join(package + ([base] if base else []))
                # `from pkg import mod` imports pkg.mod when that is a module, else names in pkg
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            else:
                continue
            found += [Import(module, _resolve(name, modules), f"{where}:{node.lineno}") for name in names]
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def violations(repo: Path) -> list[str]:
    """Every import that breaks a floor rule, as 'file:line: source imports target (why)'."""
    product = [i for i in imports(repo) if top(i.target) in FLOORS]
    out = []
    for i in product:
        src, dst = top(i.source), top(i.target)
        if FLOORS[dst] > FLOORS[src]:
            out.append(f"{i.where}: {i.source} imports {i.target} (floor {src} < floor {dst}: an upward import)")
        elif src in SERVICES and dst in SERVICES and src != dst:
            out.append(f"{i.where}: {i.source} imports {i.target} (the services never import each other)")
        if src == "nanoserve_cli" and dst in SERVICES:
            out.append(f"{i.where}: {i.source} imports {i.target} (the CLI starts services as processes)")
    return out + torch_reaches(repo) + circles(repo)


def torch_reaches(repo: Path) -> list[str]:
    """A scheduler_svc or gateway_svc module from which a chain of product imports reaches torch."""
    edges: dict[str, list[Import]] = {}
    for i in imports(repo):
        edges.setdefault(i.source, []).append(i)
    out = []
    for start in sorted(m for m in product_modules(repo) if top(m) in NO_TORCH):
        chain = _path_to_torch(start, edges, set())
        if chain:
            out.append(" -> ".join(i.where for i in chain) + f": {start} reaches {chain[-1].target} "
                       f"({top(start)} never imports torch)")
    return out


def _path_to_torch(module: str, edges: dict[str, list[Import]], seen: set[str]) -> list[Import]:
    seen.add(module)
    for i in edges.get(module, []):
        if i.target in TORCH:
            return [i]
        if top(i.target) in FLOORS and i.target not in seen:
            rest = _path_to_torch(i.target, edges, seen)
            if rest:
                return [i, *rest]
    return []


def circles(repo: Path) -> list[str]:
    """Each circle of product modules importing each other, shown as its imports."""
    edges: dict[str, dict[str, Import]] = {}
    for i in imports(repo, type_hints=True):
        if top(i.target) in FLOORS and i.target != i.source:
            edges.setdefault(i.source, {}).setdefault(i.target, i)
    out, done = [], set()

    def visit(module: str, stack: list[str]) -> None:
        for target, i in sorted(edges.get(module, {}).items()):
            if target in stack:
                cycle = stack[stack.index(target):] + [target]
                steps = [edges[a][b].where for a, b in zip(cycle, cycle[1:])]
                out.append(f"{', '.join(steps)}: a circle {' -> '.join(cycle)}")
            elif target not in done:
                visit(target, stack + [target])
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module, [module])
    return out


def test_product_code_stands_on_its_floors():
    assert violations(REPO) == []


def test_no_product_modules_import_each_other_in_a_circle():
    """Inside a service too, type hints included: 0 circles."""
    found = circles(REPO)
    assert len(found) == 0, "\n".join(found)


def test_every_floor_is_found():
    """The checker reads the real tree: each package that exists here contributes imports."""
    sources = {top(i.source) for i in imports(REPO)}
    assert set(package_roots(REPO)) <= sources | {"gateway_svc"}
    assert {"nanoserve", "nanoserve_kernels", "nanoserve_model", "worker_svc", "scheduler_svc",
            "nanoserve_cli"} <= sources


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_names_each_kind_of_offence_by_file_and_line(tmp_path):
    repo = _tree(tmp_path, {
        "proto/nanoserve/__init__.py": "",
        "proto/nanoserve/flags.py": "import os\n",
        "nanoserve_kernels/__init__.py": "",
        "nanoserve_kernels/ops.py": "import torch\n\n\ndef f():\n    from nanoserve_model import layer\n",
        "nanoserve_model/__init__.py": "",
        "nanoserve_model/layer.py": "from nanoserve_kernels.ops import f\nfrom nanoserve import flags\n",
        "scheduler_svc/__init__.py": "",
        "scheduler_svc/core.py": "from nanoserve_model.layer import f\nfrom . import loop\n",
        "scheduler_svc/loop.py": "import scheduler_svc.core\nfrom worker_svc import runner\n",
        "worker_svc/__init__.py": "",
        "worker_svc/runner.py": "from nanoserve_model import layer\n",
        "nanoserve_cli/__init__.py": "",
        "nanoserve_cli/cli.py": "import worker_svc.runner\n",
        "gateway_svc/__init__.py": "",
        "gateway_svc/app.py": "from gateway_svc.errors import E\n",
        "gateway_svc/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway_svc.app import App\n",
    })
    found = violations(repo)
    expected = [
        "nanoserve_kernels/ops.py:5: nanoserve_kernels.ops imports nanoserve_model.layer "
        "(floor nanoserve_kernels < floor nanoserve_model: an upward import)",
        "scheduler_svc/loop.py:2: scheduler_svc.loop imports worker_svc.runner (the services never import each other)",
        "nanoserve_cli/cli.py:1: nanoserve_cli.cli imports worker_svc.runner (the CLI starts services as processes)",
        "scheduler_svc/core.py:1 -> nanoserve_model/layer.py:1 -> nanoserve_kernels/ops.py:1: "
        "scheduler_svc.core reaches torch "
        "(scheduler_svc never imports torch)",
        "nanoserve_model/layer.py:1, nanoserve_kernels/ops.py:5: "
        "a circle nanoserve_model.layer -> nanoserve_kernels.ops -> nanoserve_model.layer",
        "scheduler_svc/core.py:2, scheduler_svc/loop.py:1: a circle scheduler_svc.core -> scheduler_svc.loop "
        "-> scheduler_svc.core",
        "gateway_svc/app.py:1, gateway_svc/errors.py:3: a circle gateway_svc.app -> gateway_svc.errors -> gateway_svc.app",
    ]
    for line in expected:
        assert line in found, "\n".join(found)
    assert "flags" not in " ".join(found)  # a downward import is no offence


def test_a_clean_tree_has_no_offence(tmp_path):
    repo = _tree(tmp_path, {
        "proto/nanoserve/__init__.py": "", "proto/nanoserve/wire.py": "import grpc\n",
        "nanoserve_model/__init__.py": "", "nanoserve_model/layer.py": "import torch\nfrom nanoserve import wire\n",
        "scheduler_svc/__init__.py": "", "scheduler_svc/core.py": "from nanoserve.wire import X\n",
        # a type hint that points down is no circle
        "scheduler_svc/loop.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scheduler_svc.core import X\n",
        "nanoserve_cli/__init__.py": "", "nanoserve_cli/cli.py": "from nanoserve import wire\n",
    })
    assert violations(repo) == []


@pytest.mark.parametrize("module, expected", [("scheduler_svc.server", "nanoserve.wire"),
                                              ("nanoserve_cli.cli", "nanoserve.flags")])
def test_imports_resolve_to_modules(module, expected):
    assert expected in {i.target for i in imports(REPO) if i.source == module}
