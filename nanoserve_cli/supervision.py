"""`up`'s worker ranks, kept running: a rank that exits or hangs takes its whole group down and
up starts a fresh one (with tensor parallelism a dead rank poisons the group's collectives, so
the survivors cannot go on). The scheduler holds its requests meanwhile and recomputes them on
the new group (scheduler_svc/recovery.py).

An exit is seen at once: a thread per rank waits on it and wakes the launcher. A rank hangs when it
stops answering its health check for HANG_GRACE_SECONDS longer than --step-timeout, after having
answered once (a rank still importing or loading is not probed into a restart); the grace lets the
scheduler, which stops waiting for a step at --step-timeout, see the hang first and name the step.
Restarts in a row wait longer each time, from none to WORKER_RESTART_BACKOFF_MAX, and after
--max-worker-restarts of them up gives up; a group that served (every rank SERVING) for
WORKER_GROUP_STABLE_SECONDS starts the count over (both declared with the flag that tells users).

With --standby-workers a standby process per rank (nanoserve.standby), started once the group
serves, has done its imports and waits: a restart tells the standbys to go on as the new group
instead of starting processes, and new standbys start behind them once that group serves.
"""
import signal
import subprocess
import threading
import time
from typing import Callable

import grpc

from nanoserve.flags import WORKER_GROUP_STABLE_SECONDS, WORKER_RESTART_BACKOFF_MAX
from nanoserve.healthcheck import SERVING, serving_status

PROBE_SECONDS = 1.0
HANG_GRACE_SECONDS = 5.0


class GaveUp(Exception):
    """The group kept failing: the message says how often and why the last one ended."""


class Liveness:
    """When each rank last answered its health check, probed on a thread of its own."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.last_answer: list[float | None] = [None] * len(addresses)
        self.serving = [False] * len(addresses)
        self.stopped = threading.Event()
        threading.Thread(target=self._probe, name="worker-liveness", daemon=True).start()

    def _probe(self) -> None:
        while not self.stopped.wait(PROBE_SECONDS):
            for rank, address in enumerate(self.addresses):
                try:
                    status = serving_status(address, timeout=PROBE_SECONDS)
                except grpc.RpcError:
                    continue
                self.last_answer[rank] = time.monotonic()
                self.serving[rank] = status == SERVING

    def silent_for(self, rank: int) -> float:
        """Seconds since the rank last answered; 0 until it first has."""
        last = self.last_answer[rank]
        return 0.0 if last is None else time.monotonic() - last

    def stop(self) -> None:
        self.stopped.set()


class WorkerGroupSupervisor:
    """Starts the ranks through start_group(standbys) (given the standbys to go on as the group, or
    none), and replaces the whole group whenever check() finds one of them exited or hung; with
    start_standbys, keeps a standby per rank once the group serves. `wake` is set when a rank exits."""

    def __init__(self, start_group: Callable[[list[subprocess.Popen]], list[subprocess.Popen]], addresses: list[str],
                 describe: Callable[[subprocess.Popen], str], failure: Callable[[subprocess.Popen], str],
                 max_restarts: int, hang_seconds: float, log: Callable[[str], None],
                 start_standbys: Callable[[], list[subprocess.Popen]] | None = None,
                 wake: threading.Event | None = None):
        self.start_group, self.start_standbys, self.addresses = start_group, start_standbys, addresses
        self.describe, self.failure = describe, failure
        self.max_restarts, self.hang_seconds, self.log = max_restarts, hang_seconds, log
        self.wake = wake or threading.Event()
        self.restarts_in_a_row = 0
        self.procs: list[subprocess.Popen] = []
        self.standbys: list[subprocess.Popen] = []
        self.liveness: Liveness | None = None
        self.served_since: float | None = None  # when every rank of the group first answered SERVING

    def start(self) -> None:
        self.procs, self.standbys = self.start_group(self.standbys), []
        for proc in self.procs:
            threading.Thread(target=self._wait_exit, args=(proc,), name=f"wait-{proc.pid}", daemon=True).start()
        self.served_since = None
        self.liveness = Liveness(self.addresses)

    def _wait_exit(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.wake.set()

    def check(self) -> None:
        """Restarts the group if a rank exited or hung (raises GaveUp past the restart limit); keeps
        the standbys."""
        why = self._trouble()
        if why is None:
            self._keep_standbys()
            return
        if (self.served_since is not None
                and time.monotonic() - self.served_since >= WORKER_GROUP_STABLE_SECONDS):
            self.restarts_in_a_row = 0
        if self.restarts_in_a_row >= self.max_restarts:
            raise GaveUp(f"the worker group failed {self.restarts_in_a_row + 1} time(s) in a row "
                         f"(--max-worker-restarts {self.max_restarts}); the last: {why}")
        self.restarts_in_a_row += 1
        pause = min(WORKER_RESTART_BACKOFF_MAX, 2.0 ** (self.restarts_in_a_row - 2)) if self.restarts_in_a_row > 1 else 0.0
        self.log(f"nanoserve up: {why}; restarting the worker group in {pause:g}s"
                 f"{' from its standbys' if self.standbys else ''} "
                 f"(restart {self.restarts_in_a_row} of at most {self.max_restarts} in a row)")
        self.stop()
        time.sleep(pause)
        self.start()

    def _keep_standbys(self) -> None:
        """Notes when the group serves; then starts its standbys, or drops them if one exited (the next
        restart starts fresh processes and new standbys follow the group it starts)."""
        if self.served_since is None and all(self.liveness.serving):
            self.served_since = time.monotonic()
            if self.start_standbys is not None:
                self.standbys = self.start_standbys()
        dead = next((proc for proc in self.standbys if proc.poll() is not None), None)
        if dead is not None:
            self.log(f"nanoserve up: the standby {self.failure(dead)}; the next restart starts fresh processes")
            self.stop_standbys()

    def _trouble(self) -> str | None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                return self.failure(proc)
            silent = self.liveness.silent_for(rank)
            if silent > self.hang_seconds + HANG_GRACE_SECONDS:
                return (f"{self.describe(proc)} has not answered for {silent:.0f}s (--step-timeout "
                        f"{self.hang_seconds:g} + {HANG_GRACE_SECONDS:g}): hung")
        return None

    def stop(self) -> None:
        """Kills every rank at once: a broken group has nothing to save, and a hung rank ignores SIGTERM."""
        if self.liveness is not None:
            self.liveness.stop()
        _kill(self.procs)

    def stop_standbys(self) -> None:
        _kill(self.standbys)
        self.standbys = []


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
