"""scheduler_svc must import where torch cannot: the scheduler container ships without it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: a finder first in sys.meta_path refuses torch, then every module
# of the package is imported.
PROBE = """
import importlib, pkgutil, sys

class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (import of {name})")

sys.meta_path.insert(0, RefuseTorch())
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("the torch blocker does not work")

import scheduler_svc
for module in pkgutil.walk_packages(scheduler_svc.__path__, "scheduler_svc."):
    importlib.import_module(module.name)
    print(module.name)
"""


def test_scheduler_svc_imports_without_torch():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    imported = result.stdout.split()
    core = {"scheduler_svc.scheduler", "scheduler_svc.block_manager", "scheduler_svc.sequence"}
    assert core <= set(imported)
