"""The requests one engine holds, and whether it serves them.

The engine's loop and its worker-group recovery both end requests and change the serving state;
both do it here, so neither reaches into the other. Handlers' aborts wait in `pending_aborts`
until the loop (or the recovery, while a group reconnects) applies them between steps.
"""
import asyncio
from collections.abc import Callable

from scheduler_svc.request_stream import RequestStream
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence


class RequestTable:
    """Request streams by sequence id, the aborts not yet applied, and the serving state that
    the health service and new requests follow."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.streams: dict[int, RequestStream] = {}
        self.pending_aborts: list[int] = []
        self.healthy = True
        self.recovering = False  # a group is being rebuilt: requests are taken, held, not admitted
        self.failure = ""
        self.on_health_change: Callable[[bool], object] = lambda healthy: None
        self.work = asyncio.Event()  # set when there is something new to schedule or abort

    @property
    def accepts_requests(self) -> bool:
        """Serving, or holding requests while a worker group comes back."""
        return self.healthy or self.recovering

    def enter_recovery(self, reason: str) -> None:
        """A rank failed: requests are held (health NOT_SERVING) until a group is back."""
        self.healthy, self.recovering, self.failure = False, True, reason
        self.on_health_change(False)

    def resume(self) -> None:
        self.healthy, self.recovering, self.failure = True, False, ""
        self.on_health_change(True)

    def give_up(self, reason: str) -> None:
        """Ends every request with `reason` (UNAVAILABLE); new ones are refused until a group serves."""
        for seq_id in list(self.streams):
            self.scheduler.abort(seq_id)
        self.end_all(reason)

    def end_all(self, reason: str) -> None:
        self.healthy, self.recovering, self.failure = False, False, reason
        self.on_health_change(False)
        self.end_requests([stream.seq for stream in self.streams.values()], reason)
        self.pending_aborts.clear()

    def end_requests(self, seqs: list[Sequence], reason: str) -> None:
        """Ends these sequences' requests with `reason` (UNAVAILABLE); the scheduler has let them go."""
        for seq in seqs:
            stream = self.streams.pop(seq.seq_id, None)
            if stream is not None:
                stream.error = reason
                stream.wakeup.set()

    def abort(self, seq_id: int) -> None:
        """Cancels a request; applied between steps so an in-flight step stays consistent."""
        if seq_id in self.streams:
            self.pending_aborts.append(seq_id)
            self.work.set()

    def apply_aborts(self) -> None:
        for seq_id in self.pending_aborts:
            if self.streams.pop(seq_id, None) is not None:
                self.scheduler.abort(seq_id)
        self.pending_aborts.clear()
