"""A service started by `nanoserve up` ends with its launcher, however the launcher ended (kill -9
included): no scheduler or worker is left serving with parent id 1.

The launcher names itself in NANOSERVE_LAUNCHER_PID; the service, at start-up, asks Linux for
SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG) and also watches its parent id on a thread,
the fallback where prctl does not exist (macOS) or the launcher died before prctl was called.
"""
import ctypes
import logging
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "NANOSERVE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_GRACE_SECONDS = 10.0  # after SIGTERM, how long a service may take to stop before it is ended

log = logging.getLogger("nanoserve.lifeline")


def follow_launcher(poll_seconds: float = 1.0) -> None:
    """Ties this process's life to the launcher named in the environment; no-op when run alone."""
    raw = os.environ.pop(LAUNCHER_PID_ENV, "")  # not inherited by anything this process starts
    if not raw:
        return
    launcher = int(raw)
    _ask_for_parent_death_signal()
    if os.getppid() != launcher:
        sys.exit(f"nanoserve: the launcher (pid {launcher}) is gone; not starting")
    threading.Thread(target=_watch, args=(launcher, poll_seconds), name="launcher-watch", daemon=True).start()


def _ask_for_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the watch thread does the work
        pass


def _watch(launcher: int, poll_seconds: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_seconds)
    log.warning("the launcher (pid %d) is gone; stopping", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_GRACE_SECONDS)
    os._exit(1)
