"""Only the step encoder and the transport know the wire: the scheduling core imports no stubs."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "scheduler_svc"
CORE = ("scheduler.py", "sequence.py", "block_manager.py", "step_plan.py", "config.py")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_scheduling_core_imports_no_wire_stubs():
    for name in CORE:
        stubs = {m for m in imported_modules(PACKAGE / name) if "_pb2" in m or m.startswith("grpc")}
        assert not stubs, f"scheduler_svc/{name} imports {sorted(stubs)}"


def test_the_encoder_is_where_the_stubs_are_imported():
    assert any("_pb2" in m for m in imported_modules(PACKAGE / "step_encoder.py"))
