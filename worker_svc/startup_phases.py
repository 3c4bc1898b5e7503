"""Where a worker's start-up time goes, phase by phase, logged as one line once the rank is ready:

    rank 0 ready in 6.12s: process start 0.31, imports 2.05, distributed+CUDA 0.95, weights 0.40,
    KV profile 1.10, handshake 0.12, graphs 1.12, first steps 0.07

A restart's time is the sum of these and what happens outside the worker (bench/chaos.py splits it;
docs/recovery-time.md names each phase). The clock starts when the process was created, or, for a
standby that was waiting with its imports done (worker_svc/standby.py), when it was told to go."""
import logging
import os
import re
import time

PHASE_LINE = re.compile(r"rank (\d+) ready in ([\d.]+)s: (.*)$")


def process_started_at() -> float:
    """Wall-clock time this process was created (Linux: /proc, to 10 ms); now where /proc is absent."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
            up_seconds = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (up_seconds - started_ticks / os.sysconf("SC_CLK_TCK"))


class StartupPhases:
    """Durations of the start-up's phases, each ended by end(name), from `started` (wall clock)."""

    def __init__(self, started: float | None = None):
        self.started = self.last = time.time() if started is None else started
        self.phases: list[tuple[str, float]] = []
        self.logged = False

    def end(self, name: str) -> None:
        """The phase `name` ran from the end of the previous one until now (once logged, a later
        re-allocation of the cache is no start-up: ignored)."""
        if self.logged:
            return
        now = time.time()
        self.phases.append((name, now - self.last))
        self.last = now

    def log_ready(self, log: logging.Logger, rank: int) -> None:
        """The one start-up line, the first time the rank is ready (a later handshake re-captures no
        start-up)."""
        if self.logged:
            return
        self.logged = True
        log.info("rank %d ready in %.2fs: %s", rank, self.last - self.started,
                 ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases))


def parse_phase_line(line: str) -> tuple[int, float, dict[str, float]] | None:
    """(rank, total seconds, {phase: seconds}) of a start-up line, None for any other line."""
    found = PHASE_LINE.search(line)
    if found is None:
        return None
    phases = dict(part.rsplit(" ", 1) for part in found.group(3).split(", "))
    return int(found.group(1)), float(found.group(2)), {name: float(secs) for name, secs in phases.items()}
