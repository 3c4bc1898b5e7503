"""A worker started as a standby (nanoserve.standby): it does the imports of a rank's start-up, then
waits for the launcher's word, holding no port, no process group and no GPU memory (CUDA is not
initialised), about 1 GB of host memory for its imported modules. Taking a dead rank's place, it
skips the process start and the imports, seconds of a restart (docs/recovery-time.md)."""
import ctypes
import importlib
import logging
import os
import sys

from nanoserve.standby import GO, PROCESS_NAME, STANDBY_ENV
from worker_svc.config import WorkerConfig

log = logging.getLogger("nanoserve.worker")
_PR_SET_NAME = 15

# What a rank's start-up imports after the worker's entry point: the runner (torch, the model, the
# kernels) and, where it will compute on CUDA, Triton, which its kernels import on their first CUDA call.
RUNNER_MODULES = ("worker_svc.server", "worker_svc.runner")
CUDA_MODULES = ("triton",)


def started_as_standby() -> bool:
    """Whether the launcher started this process as a standby (not inherited by its own children)."""
    return os.environ.pop(STANDBY_ENV, "") == "1"


def stand_by(config: WorkerConfig) -> bool:
    """Imports ahead, then waits on stdin; True once told to go on as the rank, False when the
    launcher closed stdin instead."""
    own_name = _process_name()
    _set_process_name(PROCESS_NAME)
    for module in RUNNER_MODULES:
        importlib.import_module(module)
    from worker_svc.distributed import uses_cuda

    if uses_cuda(config):  # asks the driver for its devices; creates no CUDA context
        for module in CUDA_MODULES:
            importlib.import_module(module)
    log.info("standby for rank %d: imports done, waiting", config.rank)
    told = sys.stdin.buffer.readline()
    _set_process_name(own_name)
    return told == GO


def _process_name() -> str:
    try:
        with open("/proc/self/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _set_process_name(name: str) -> None:
    if not name or sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
