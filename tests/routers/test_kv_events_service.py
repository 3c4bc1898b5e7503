"""A scheduler started with vLLM's --kv-events-config publishes what a precise prefix router indexes:
the blocks of a prompt it computed (their hashes recomputed here from the token ids, with xxhash),
and AllBlocksCleared as soon as its worker dies, before a restarted worker computes them again."""
import json
import time
from pathlib import Path

from nanoserve.client import Client
from tests.routers.kv_event_subscriber import AllBlocksCleared, BlockStored, Subscriber, apply, chain
from tests.services.processes import free_port, running_service, start_worker, wait_serving

BLOCK_SIZE = 16
PROMPT = [(i * 37 + 11) % 5000 for i in range(50)]  # three full blocks and two tokens
WORKER_FLAGS = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64")


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


def test_events_follow_the_prefix_cache_through_a_worker_restart(tiny_model_dir, tmp_path):
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv-events",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv@replica-0@tiny"}
    prompt_blocks = chain(None, PROMPT[:3 * BLOCK_SIZE], BLOCK_SIZE)
    log = tmp_path / "services.log"
    subscriber = Subscriber(config["endpoint"], config["replay_endpoint"])
    with running_service(Path(tiny_model_dir), log, worker_flags=WORKER_FLAGS,
                         scheduler_flags=("--kv-events-config", json.dumps(config))) as service:
        try:
            with Client(service["address"]) as client:
                client.generate(PROMPT, max_tokens=4, temperature=0)
                before = history_until(subscriber, lambda b: set(prompt_blocks) <= cached(b))
                stored = [e for b in before for e in b.events if isinstance(e, BlockStored)]
                assert stored[0].block_hashes[:3] == prompt_blocks and stored[0].parent_block_hash is None
                assert stored[0].token_ids[:3 * BLOCK_SIZE] == PROMPT[:3 * BLOCK_SIZE]

                worker = service["workers"][0]
                port = int(worker.args[worker.args.index("--port") + 1])
                worker.kill()
                worker.wait()
                cleared = history_until(subscriber, lambda b: isinstance(b[-1].events[-1], AllBlocksCleared))
                assert cached(cleared) == set()
                service["procs"][0] = start_worker(Path(tiny_model_dir), port, *WORKER_FLAGS, log=log)
                wait_serving(service["address"], service["procs"], log)

                client.generate(PROMPT, max_tokens=4, temperature=0)
                after = history_until(subscriber, lambda b: set(prompt_blocks) <= cached(b))
                assert len(after) > len(cleared) and subscriber.topics == {b"kv@replica-0@tiny"}
        finally:
            subscriber.close()
