"""KV events as a router receives them, after a fuzzed workload that evicts cached blocks, preempts
sequences and drops the KV of a failed worker group: the scheduler publishes over ZMQ (vLLM's wire),
a vLLM-shaped consumer decodes the batches (live, and from the replay socket) and its replay
reproduces the scheduler's set of cached block hashes at every checkpoint; each stored block's hash
is the xxh64 chain of its token ids."""
import random
import time

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_event_publisher import KVEventPublisher
from scheduler_svc.kv_events_config import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence
from tests.routers.kv_event_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, apply, chain
from tests.services.processes import free_port

BLOCK_SIZE = 4
PREFIXES = [[5] * 12, list(range(1, 18)), list(range(30, 39))]


def cached_hashes(scheduler: Scheduler) -> set[int]:
    return set(scheduler.block_manager.hash_to_block_id)


def fuzz(scheduler: Scheduler, publisher: KVEventPublisher, rng: random.Random, steps: int,
         drop_at: set[int]) -> list[tuple[int, set[int]]]:
    """Runs requests through the scheduler, flushing events once per step as the engine does; at the
    steps in `drop_at` the KV is dropped as a worker-group recovery drops it. Returns checkpoints:
    (batches published so far, the scheduler's cached hashes then)."""
    checkpoints, published, next_id = [], 0, 0
    for step in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(PREFIXES) + [rng.randrange(1, 60) for _ in range(rng.randint(1, 20))]
            scheduler.enqueue(Sequence(next_id, prompt, SamplingOptions(max_tokens=rng.randint(1, 30))))
            next_id += 1
        if rng.random() < 0.02 and scheduler.running:
            scheduler.abort(rng.choice(scheduler.running).seq_id)
        if step in drop_at:
            scheduler.drop_kv(scheduler.num_total_blocks - 2)  # the restarted group holds a little less
        plan = scheduler.schedule()
        if plan is not None:
            scheduler.postprocess(plan, [rng.randrange(1, 60) for _ in plan.sampled])
        published += bool(publisher.log.events)
        publisher.flush()
        if step % 50 == 0:
            checkpoints.append((published, cached_hashes(scheduler)))
    checkpoints.append((published, cached_hashes(scheduler)))
    return checkpoints


def test_replayed_events_reproduce_the_cached_hashes(tmp_path):
    # The PUB socket on a local IPC path (bound, as vLLM binds ipc://), the replay socket on loopback TCP.
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv-events",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv@test")
    subscriber = Subscriber(config.endpoint, config.replay_endpoint)
    publisher = KVEventPublisher(config, BLOCK_SIZE)
    subscriber.wait_joined()
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=40, block_size=BLOCK_SIZE, max_model_len=120,
                                          max_num_seqs=6, max_num_batched_tokens=32), publisher.log)
    try:
        checkpoints = fuzz(scheduler, publisher, random.Random(0), steps=1500, drop_at={600, 1100})
        live = subscriber.live(timeout=1.0)
        batches = subscriber.history(live)
    finally:
        publisher.close()
        subscriber.close()
    assert subscriber.topics == {b"kv@test"}
    assert scheduler.num_preemptions > 10 and scheduler.prefix_cache_hit_tokens > 0
    events = [event for batch in batches for event in batch.events]
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 2
    assert sum(isinstance(e, BlockRemoved) for e in events) > 10  # cached blocks handed out again
    assert len(batches) == checkpoints[-1][0]

    seen, applied = set(), 0
    for count, expected in checkpoints:
        for batch in batches[applied:count]:
            apply(seen, batch)
        applied = count
        assert seen == expected
    for event in events:
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK_SIZE and event.medium == "GPU" and event.lora_id is None
            assert event.block_hashes == chain(event.parent_block_hash, event.token_ids, BLOCK_SIZE)
    assert all(batch.data_parallel_rank == 0 and batch.ts <= time.time() for batch in batches)


def test_a_slow_reader_gets_its_whole_replay(tmp_path):
    # More batches than a ROUTER queues for one peer by default (1,000), to a reader with a tiny socket
    # buffer that starts reading late: every batch arrives, in order, with the end marker.
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv-events",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    subscriber = Subscriber(config.endpoint, config.replay_endpoint, receive_buffer=4096)
    publisher = KVEventPublisher(config, BLOCK_SIZE)
    try:
        for block in range(3000):
            publisher.log.removed(block)
            publisher.flush()
        subscriber.wait_joined()
        subscriber.live(timeout=1.0)
        replayed = subscriber.replay(0, read_after=1.0)
    finally:
        publisher.close()
        subscriber.close()
    assert sorted(replayed) == list(range(3000))


def test_kv_events_config_takes_vllms_json():
    assert not parse_kv_events_config("").enabled
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    assert on.enabled and (on.endpoint, on.replay_endpoint, on.topic) == ("tcp://*:5557", "tcp://*:5558", "")
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for text, problem in [("{", "is not JSON"), ("[1]", "must be a JSON object"),
                          ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events=1 should be bool"),
                          ('{"endpiont": "tcp://*:1"}', "unknown keys ['endpiont']"),
                          ('{"publisher": "kafka"}', "publisher='kafka' should be one of zmq, null"),
                          ('{"buffer_steps": 0}', "buffer_steps should be at least 1")]:
        with pytest.raises(KVEventsConfigError, match="^--kv-events-config ") as caught:
            parse_kv_events_config(text)
        assert problem in str(caught.value)
