"""gateway_svc stands beside the scheduler: it imports no torch, no transformers and nothing of
the other services, only the contract package `nanoserve`."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, pkgutil, sys

BLOCKED = ("torch", "transformers", "scheduler_svc", "worker_svc", "nanoserve_model", "nanoserve_kernels")

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Refuse())
import gateway_svc
for module in pkgutil.walk_packages(gateway_svc.__path__, "gateway_svc."):
    importlib.import_module(module.name)
    print(module.name)
"""


def test_gateway_imports_only_the_contract_package():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert {"gateway_svc.app", "gateway_svc.generation", "gateway_svc.__main__"} <= set(result.stdout.split())
