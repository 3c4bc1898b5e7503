"""Which scheduler a worker serves: one session at a time.

A scheduler makes a random session id for each connection of its worker group and sends it with
AllocateKVCache (the handshake) and when it opens its Step stream. The session that allocated the
KV cache holds the worker while it is live: from the start of its allocation until its Step
stream closes (its scheduler stopped, died, or gave the group up after a failure), or, if it never
opens one, until OPEN_STREAM_SECONDS after the allocation finished. Meanwhile another session's
AllocateKVCache or Step is refused, naming the holder; once the holder's stream has closed, the
next session to allocate takes the worker over. So a second scheduler pointed at a live worker
cannot reset it, and a restarted scheduler takes over as soon as the worker has seen its
predecessor's stream end: at once when that process died on a reachable host, within the
keepalive timeout (nanoserve.wire.SERVER_OPTIONS) when its host vanished.
"""
import threading
import time
from dataclasses import dataclass

# A scheduler opens its Step stream right after allocating; one whose group failed on another rank
# never does, and its next session waits this long for the worker.
OPEN_STREAM_SECONDS = 10.0


class SessionRefused(Exception):
    """Another session holds this worker; the message names it."""


@dataclass
class _Session:
    session_id: str
    peer: str
    since: float
    allocated_at: float | None = None  # None while the allocation runs
    streams: int = 0                   # Step streams open now
    streamed: bool = False             # one has opened (and maybe closed) since the allocation

    def live(self, now: float) -> bool:
        if self.allocated_at is None or self.streams > 0:
            return True
        return not self.streamed and now - self.allocated_at < OPEN_STREAM_SECONDS

    def describe(self, now: float) -> str:
        state = ("it is allocating the KV cache" if self.allocated_at is None else
                 "its step stream is open" if self.streams else "it has not opened its step stream yet")
        return f"scheduler session {self.session_id[:8]} from {self.peer} (for {now - self.since:.0f}s; {state})"


class Sessions:
    """The holder of one worker, consulted by every AllocateKVCache and Step (thread-safe)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._holder: _Session | None = None

    def begin_allocation(self, session_id: str, peer: str) -> None:
        """Makes `session_id` the holder, unless another live session holds the worker."""
        with self._lock:
            now = self._clock()
            holder = self._holder
            if holder is not None and holder.session_id != session_id and holder.live(now):
                raise SessionRefused(f"this worker serves {holder.describe(now)}; it serves one scheduler at "
                                     "a time: stop that scheduler first (a new one is accepted once its step "
                                     "stream has closed)")
            self._holder = _Session(session_id, peer, since=now)

    def end_allocation(self, session_id: str, ok: bool) -> None:
        """The allocation finished: the session waits for its stream, or, failed, holds nothing."""
        with self._lock:
            if self._holder is not None and self._holder.session_id == session_id:
                if ok:
                    self._holder.allocated_at = self._clock()
                else:
                    self._holder = None

    def open_stream(self, session_id: str) -> None:
        """Admits a Step stream of the holding session; any other is refused."""
        with self._lock:
            now = self._clock()
            holder = self._holder
            if holder is None or holder.session_id != session_id:
                held = f"is held by {holder.describe(now)}" if holder is not None else "has no KV cache allocated"
                raise SessionRefused(f"a step stream of scheduler session {session_id[:8]} was "
                                     f"refused: this worker {held}; call AllocateKVCache first")
            if not holder.live(now):
                raise SessionRefused(f"scheduler session {session_id[:8]} has ended (its step stream closed, or "
                                     f"none opened within {OPEN_STREAM_SECONDS:.0f}s of its allocation); start a "
                                     "new session with AllocateKVCache")
            holder.streams += 1
            holder.streamed = True

    def held(self) -> bool:
        """A live session holds this worker (its scheduler may still send steps)."""
        with self._lock:
            return self._holder is not None and self._holder.live(self._clock())

    def close_stream(self, session_id: str) -> None:
        with self._lock:
            if self._holder is not None and self._holder.session_id == session_id:
                self._holder.streams -= 1
