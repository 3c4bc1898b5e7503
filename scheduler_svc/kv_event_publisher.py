"""KV events over ZeroMQ, as vLLM publishes them (vllm/distributed/kv_events.py, ZmqEventPublisher).

Each engine step's events go out as one batch: a PUB message of three frames, the topic, the batch's
sequence number (8 bytes, big-endian, from 0) and the msgpack batch [ts, events, data_parallel_rank]
(msgspec's array-like encoding of vLLM's KVEventBatch; events as kv_event_log.py writes them). The
last `buffer_steps` batches are kept for the replay socket: a ROUTER that, sent [b"", start sequence
(8 bytes)] by a DEALER or REQ, answers [b"", sequence, batch] for every kept batch from that sequence
on, then [b"", -1, b""]. A subscriber that sees a gap in the sequence numbers asks for it there.

The engine's thread only appends to a queue (flush, once per step); a thread of this publisher packs
and sends, and answers replays. Batches that find the queue full are dropped and the next batch
starts with AllBlocksCleared, so a consumer never keeps a block it missed the removal of.
Needs pyzmq and msgpack (`pip install 'nanoserve[kv-events]'`), imported only when events are on.
"""
import collections
from array import array
import logging
import queue
import threading
import time

import msgpack
import zmq

from scheduler_svc.kv_event_log import KVEventLog
from scheduler_svc.kv_events_config import KVEventsConfig

log = logging.getLogger("nanoserve.scheduler")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DATA_PARALLEL_RANK = 0  # a replica is one scheduler: several replicas are told apart by their endpoints
REPLAY_SEND_TIMEOUT_MS = 1000  # how long a replay waits for a reader that does not take it before giving up


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int):
        self.log = KVEventLog(block_size)
        self.topic = config.topic.encode()
        self.max_queue_size = config.max_queue_size
        self.batches: queue.SimpleQueue = queue.SimpleQueue()  # (ts, events), or None to stop
        self.dropped = False
        self.kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.replay = self.context.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            self.pub.set_hwm(config.hwm)
            if _binds(config.endpoint):
                self.pub.bind(config.endpoint)
            else:
                self.pub.connect(config.endpoint)
            if self.replay is not None:
                # A whole replay (every kept batch and its end) fits the reader's queue, and a queue that is
                # still full fails the send (ROUTER_MANDATORY) instead of dropping batches from its middle.
                self.replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay.setsockopt(zmq.SNDTIMEO, REPLAY_SEND_TIMEOUT_MS)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: "
                          f"{err}") from None
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        log.info("publishing KV events on %s%s (topic %r)", config.endpoint,
                 f", replaying on {config.replay_endpoint}" if self.replay is not None else "", config.topic)

    def flush(self) -> None:
        """Queues the events logged since the last flush as one batch (none: nothing is sent)."""
        events = self.log.take()
        if not events:
            return
        if self.batches.qsize() >= self.max_queue_size:
            if not self.dropped:
                log.error("KV events: %d batches wait to be sent; dropping until the queue drains (consumers "
                          "then get AllBlocksCleared)", self.max_queue_size)
            self.dropped = True
            return
        if self.dropped:
            events.insert(0, ["AllBlocksCleared"])
            self.dropped = False
        self.batches.put((time.time(), events))

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self.batches.put(None)
        self.thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self.pub, self.replay):
            if socket is not None:
                socket.close(linger=0)
        self.context.term()

    def _run(self) -> None:
        sequence = 0
        while True:
            try:
                if self.replay is not None and self.replay.poll(0):
                    self._answer_replay()
                try:
                    batch = self.batches.get(timeout=0.01)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = msgpack.packb([batch[0], batch[1], DATA_PARALLEL_RANK], default=_as_list)
                self.pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
                self.kept.append((sequence, payload))
                sequence += 1
            except Exception:  # a bug must not end the thread: the engine's batches would pile up unsent
                log.exception("KV events: publishing failed")

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignored a replay request of %d frame(s); send [b'', start sequence as 8 "
                        "bytes big-endian]", len(frames) - 1)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        try:
            for sequence, payload in list(self.kept):
                if sequence >= first:
                    self.replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))
        except zmq.ZMQError as err:  # the reader left, or has not read its earlier replays: it gets no end marker
            log.warning("KV events: a replay from %d stopped, its reader does not take it (%s)", first, err)


def _as_list(token_ids: array) -> list[int]:
    """msgpack's hook for what it cannot pack: the token id arrays of BlockStored."""
    return token_ids.tolist()


def _binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard (or a local transport) is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
