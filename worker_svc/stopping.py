"""How a worker rank stops on SIGINT or SIGTERM: while it loads, at once; while it serves, once its
scheduler has let go of it (a draining scheduler still steps its requests in flight), within
--shutdown-timeout and a margin for the scheduler's own end; a second signal stops it at once.
No traceback either way: a stop is not a failure."""
import signal
import threading
import time
from typing import Callable

# Past --shutdown-timeout the scheduler ends what is left and closes its step streams; this covers that.
RELEASE_MARGIN_SECONDS = 5.0
_POLL_SECONDS = 0.2


class StoppedWhileLoading(BaseException):
    """A stop signal came before the model was loaded (a BaseException: no `except Exception` keeps loading)."""


class WorkerStop:
    """The rank's stop signals, taken from construction on."""

    def __init__(self, shutdown_timeout: float):
        self.shutdown_timeout = shutdown_timeout
        self.serving = False
        self.asked = threading.Event()
        self.at_once = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._signalled)

    def _signalled(self, signum, frame) -> None:
        if not self.serving:
            raise StoppedWhileLoading()
        (self.at_once if self.asked.is_set() else self.asked).set()

    def wait_asked(self) -> None:
        self.serving = True
        self.asked.wait()

    def wait_released(self, held: Callable[[], bool]) -> bool:
        """Waits while `held()` (a scheduler session is live), up to the timeout plus the margin or a
        second signal; True when the scheduler let go."""
        deadline = time.monotonic() + self.shutdown_timeout + RELEASE_MARGIN_SECONDS
        while held():
            if self.at_once.wait(_POLL_SECONDS) or time.monotonic() >= deadline:
                return False
        return True
