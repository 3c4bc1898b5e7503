"""Ends a worker rank whose step hangs: a device that stopped making progress, or a collective
whose peer rank hangs. The scheduler gives up waiting at --step-timeout too, but only an exit lets
this rank's supervisor (`nanoserve up`, or a container's restart policy) start it afresh."""
import threading
import time

from worker_svc.distributed import exit_broken_rank


class StepWatchdog:
    """Watches the steps launched and not yet answered; exits the process when the oldest has
    been running longer than `timeout` seconds. Checked on a thread of its own, once a second."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.unanswered: dict[int, tuple[int, float]] = {}  # id(step) -> (step id, launched at), in launch order
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    def launched(self, step: object, step_id: int) -> None:
        with self.lock:
            self.unanswered[id(step)] = (step_id, time.monotonic())

    def answered(self, step: object) -> None:
        with self.lock:
            self.unanswered.pop(id(step), None)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self.lock:
                oldest = next(iter(self.unanswered.values()), None)
            if oldest is not None and time.monotonic() - oldest[1] > self.timeout:
                exit_broken_rank(f"step {oldest[0]} has not finished within {self.timeout:g}s (--step-timeout): "
                                 "the device or a peer rank hangs")
