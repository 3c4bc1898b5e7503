"""A scheduler started with vLLM's --kv-events-config (conftest.py) publishes what a precise prefix
router indexes: the blocks of a prompt it computed (their hashes recomputed here from the token ids,
with xxhash), and AllBlocksCleared as soon as its worker dies, before a restarted worker computes
them again."""
import time
from pathlib import Path

from nanoserve.client import Client
from tests.routers.conftest import BLOCK_SIZE, MAX_NUM_SEQS, NUM_KV_BLOCKS
from tests.routers.kv_event_subscriber import AllBlocksCleared, BlockStored, Subscriber, apply, chain
from tests.services.processes import start_worker, wait_serving

PROMPT = [(i * 37 + 11) % 5000 for i in range(50)]  # three full blocks and two tokens


def history_until(subscriber: Subscriber, done, timeout: float = 60) -> list:
    """The batches published so far, once `done(batches)` holds."""
    live, deadline = {}, time.monotonic() + timeout
    while True:
        live.update(subscriber.live(timeout=0.3))
        batches = subscriber.history(live)
        if done(batches):
            return batches
        assert time.monotonic() < deadline, f"timed out; events so far: {[b.events for b in batches]}"


def cached(batches) -> set[int]:
    seen: set[int] = set()
    for batch in batches:
        apply(seen, batch)
    return seen


def test_events_follow_the_prefix_cache_through_a_worker_restart(replicas, tiny_model_dir):
    replica = replicas[1]
    config = replica["kv_events"]
    prompt_blocks = chain(None, PROMPT[:3 * BLOCK_SIZE], BLOCK_SIZE)
    subscriber = Subscriber(config["endpoint"], config["replay_endpoint"])
    try:
        with Client(replica["address"]) as client:
            client.generate(PROMPT, max_tokens=4, temperature=0)
            before = history_until(subscriber, lambda b: set(prompt_blocks) <= cached(b))
            [stored] = [e for b in before for e in b.events
                        if isinstance(e, BlockStored) and e.block_hashes[:1] == prompt_blocks[:1]]
            assert stored.block_hashes[:3] == prompt_blocks and stored.parent_block_hash is None
            assert stored.token_ids[:3 * BLOCK_SIZE] == PROMPT[:3 * BLOCK_SIZE] and stored.block_size == BLOCK_SIZE

            worker = replica["worker"]
            worker.kill()
            worker.wait()
            cleared = history_until(subscriber, lambda b: isinstance(b[-1].events[-1], AllBlocksCleared))
            assert cached(cleared) == set()
            flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--max-num-seqs", str(MAX_NUM_SEQS))
            procs = replica["procs"]
            replica["worker"] = procs[procs.index(worker)] = start_worker(
                Path(tiny_model_dir), replica["worker_port"], *flags, log=replica["log"])
            wait_serving(replica["address"], procs, replica["log"])

            client.generate(PROMPT, max_tokens=4, temperature=0)
            after = history_until(subscriber, lambda b: set(prompt_blocks) <= cached(b))
            assert len(after) > len(cleared) and subscriber.topics == {config["topic"].encode()}
    finally:
        subscriber.close()
