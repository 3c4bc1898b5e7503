"""The committed Python stubs must be what `make proto` generates from the .proto files."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ["llm_pb2.py", "llm_pb2.pyi", "llm_pb2_grpc.py", "worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py"]


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(REPO / "proto")) for p in (REPO / "proto/nanoserve/v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO / "proto"),
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos],
                   check=True)
    for name in GENERATED:
        fresh = (tmp_path / "nanoserve/v1" / name).read_text()
        committed = (REPO / "proto/nanoserve/v1" / name).read_text()
        assert fresh == committed, f"proto/nanoserve/v1/{name} is stale: run `make proto` and commit it"
