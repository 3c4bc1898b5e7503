"""A KV event consumer written as vLLM's subscribers are: msgspec structs in vLLM's shapes
(vllm/distributed/kv_events.py: array-like, tagged), a SUB socket for the live batches and a DEALER
on the replay socket for the ones it missed. It knows nothing of nanoserve's code."""
import time
from array import array
from typing import Any

import msgspec
import xxhash
import zmq

END_OF_REPLAY = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def chain(parent: int | None, token_ids: list[int], block_size: int) -> list[int]:
    """The engine's block keys recomputed from token ids: xxh64 over each block's uint32 ids, seeded
    with the previous block's key (what a consumer keying blocks its own way would redo with its hash)."""
    keys = []
    for start in range(0, len(token_ids), block_size):
        parent = xxhash.xxh64_intdigest(array("I", token_ids[start:start + block_size]).tobytes(), seed=parent or 0)
        keys.append(parent)
    return keys


def apply(cached: set[int], batch: KVEventBatch) -> None:
    """A consumer's view of which hashes the replica holds, after one batch."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()


class Subscriber:
    """Connects to the publisher's PUB `endpoint` (which binds it) and asks `replay_endpoint` for gaps."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"", receive_buffer: int = -1):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.RECONNECT_IVL, 10)  # a publisher bound later is joined within ~10 ms
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        self.replay_socket = self.context.socket(zmq.DEALER)
        self.replay_socket.setsockopt(zmq.RCVBUF, receive_buffer)  # -1: the system's size
        self.replay_socket.connect(replay_endpoint)
        self.topics: set[bytes] = set()

    def close(self) -> None:
        self.context.destroy(linger=0)

    def wait_joined(self, timeout: float = 30) -> None:
        """Blocks until the SUB socket has met the publisher (a PUB drops what it sends before a
        subscriber joins: a loaded machine can take longer to join than a short run takes to publish)."""
        assert self.monitor.poll(int(timeout * 1000)), "the subscriber never reached the publisher"
        self.monitor.recv_multipart()
        time.sleep(0.1)  # its subscription, sent right after the handshake, reaches the publisher

    def live(self, timeout: float) -> dict[int, bytes]:
        """Sequence -> payload of the batches that arrive until none has for `timeout` seconds."""
        received = {}
        while self.sub.poll(int(timeout * 1000)):
            topic, sequence, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            received[int.from_bytes(sequence, "big")] = payload
        return received

    def replay(self, start: int, timeout: float = 10, read_after: float = 0) -> dict[int, bytes]:
        """Every batch the publisher still keeps from `start` on (read `read_after` seconds after asking)."""
        self.replay_socket.send_multipart((b"", start.to_bytes(8, "big")))
        time.sleep(read_after)
        replayed, deadline = {}, time.monotonic() + timeout
        while True:
            assert self.replay_socket.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "no replay answer"
            _, sequence, payload = self.replay_socket.recv_multipart()
            number = int.from_bytes(sequence, "big", signed=True)
            if number == END_OF_REPLAY:
                return replayed
            replayed[number] = payload

    def history(self, live: dict[int, bytes]) -> list[KVEventBatch]:
        """Every batch in order: the live ones, and the ones missed (a late join, a gap) from the replay
        socket, which must agree with what arrived live."""
        replayed = self.replay(0)
        assert sorted(replayed) == list(range(len(replayed))), "the replay is not the sequence from 0"
        assert set(live) <= set(replayed) and all(replayed[n] == live[n] for n in live)
        return [DECODER.decode(replayed[n]) for n in sorted(replayed)]
