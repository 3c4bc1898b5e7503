"""Work that two threads may each be first to need, run once by whichever comes first.

The grammar's advance after a step (grammar_masks.py) is such work: the step's reply thread runs it
once it has answered the step, but where that thread is late the launcher needs it done
before the next masked draw, and a new sequence's first mask in the same slot must come after it.
"""
import threading
from typing import Callable


class RunOnce:
    def __init__(self, work: Callable[[], None]):
        self._work: Callable[[], None] | None = work
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def run(self) -> None:
        """Runs the work unless it has run, waiting while another thread runs it; raises its error."""
        with self._lock:
            self._run_here()
        if self._error is not None:
            raise self._error

    def run_unless_busy(self) -> None:
        """Runs the work unless it has run or another thread is running it, without waiting; an error
        is kept for run()'s caller (a thread that must not wait, nor fail, for it: a step's reply)."""
        if self._lock.acquire(blocking=False):
            try:
                self._run_here()
            finally:
                self._lock.release()

    def _run_here(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            try:
                work()
            except Exception as err:  # noqa: BLE001 (raised again by run(), on the thread that needs the work)
                self._error = err
