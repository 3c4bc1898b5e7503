"""How `nanoserve up` stops its children: front to back, each tier drained before the next is told.

The children run in sessions of their own, so a terminal's Ctrl-C reaches the launcher alone and the
launcher says who stops when. First the tier that takes requests (the router, the gateways and the
schedulers, at once): each reports NOT_SERVING, refuses new requests and lets those in flight finish
within --shutdown-timeout. Then the worker ranks, whose schedulers have let go of them by then. A
second Ctrl-C or SIGTERM passes the signal on to every child still running: each stops at once.
"""
import signal
import subprocess
import time

# After --shutdown-timeout a server ends what is left and exits; this covers that and its exit.
EXIT_MARGIN_SECONDS = 10.0


class StopSignals:
    """SIGINT and SIGTERM for the launcher: the first raises KeyboardInterrupt where the launcher is
    (one handler for both, so a container's SIGTERM stops it as Ctrl-C does); any later one goes to
    `hurry`, never as a second KeyboardInterrupt through the stop under way."""

    def __init__(self):
        self.asked = False
        self.hurry = lambda: None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._signalled)

    def _signalled(self, signum, frame) -> None:
        if self.asked:
            self.hurry()
            return
        self.asked = True
        raise KeyboardInterrupt


def stop_in_order(tiers: list[list[subprocess.Popen]], shutdown_timeout: float, signals: StopSignals) -> None:
    """SIGTERM to each tier in turn once the one before has exited (or overstayed its drain: killed)."""
    signalled: list[subprocess.Popen] = []

    def hurry() -> None:  # the second signal: everyone told so far is told again
        for proc in signalled:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    signals.asked = True  # a stop that began otherwise (a failed child) is hurried by a signal too
    signals.hurry = hurry
    for tier in tiers:
        signalled += tier
        stop_tier(tier, shutdown_timeout + EXIT_MARGIN_SECONDS)


def stop_tier(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to the running ones, then waits for them, killing those that outstay `timeout`."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
