"""Two nanoserve replicas behind a real SMG router.

SMG runs as `nanoserve up --data-parallel-size 2` runs it (nanoserve_cli/router.py's command line).
Cache-aware routing: 8 prompt groups, each sharing a long prefix, 8 requests each, sent one group
after another in an order that round robin spreads over both replicas; each replica's KV pool holds
the prefixes of about half the groups, so the prefixes compete. The prefix-cache hit rate is read from
the replicas' own GetStats. The same policy spreads a burst of unrelated prompts (the throughput
workload's random token ids, as text, all at once, right after the router starts) evenly: each
replica's share is counted by its GetStats. Load-aware routing: with one replica kept busy by requests sent to it
directly (so SMG's own counts know nothing of them), SMG's least-load policy, fed by /v1/loads (KV
usage and queue), sends new requests to the idle one."""
import asyncio
import contextlib
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from tokenizers import Tokenizer

from bench.serve import make_requests
from nanoserve.client import Client
from tests.routers.smg_process import SMG_INSTALLED, running_smg

pytestmark = pytest.mark.skipif(not SMG_INSTALLED, reason="SMG is not installed (pip install smg, requirements-dev.txt)")

GROUPS, PER_GROUP = 8, 8  # a prefix takes 11 blocks: a replica's pool (conftest.py) holds six of the eight


def prefixes(seed: int) -> list[str]:
    """A long, distinct opening (~180 tokens, 11 blocks) per group."""
    rng = random.Random(seed)
    words = ["river", "stone", "lantern", "orbit", "meadow", "copper", "violet", "harbor", "signal", "quartz",
             "ember", "falcon", "glacier", "thimble", "cobalt", "saffron", "tundra", "walnut", "zephyr", "marble"]
    return [f"Group {g} briefing: " + " ".join(rng.choice(words) for _ in range(120)) for g in range(GROUPS)]


def hit_rate(replicas: list[dict], send) -> float:
    """Prefix-cache hit tokens over prompt tokens, on both replicas, of what `send()` does."""
    def totals() -> tuple[int, int]:
        stats = []
        for replica in replicas:
            with Client(replica["address"]) as client:
                stats.append(client.stats())
        return sum(s.prefix_cache_hit_tokens for s in stats), sum(s.prompt_tokens_total for s in stats)

    hits, prompts = totals()
    send()
    hits_after, prompts_after = totals()
    return (hits_after - hits) / (prompts_after - prompts)


def send_groups(url: str, model: str, openings: list[str]) -> None:
    """Round r starts at group r: round robin sends a group to one replica, then the other."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for round_ in range(PER_GROUP):
            for i in range(GROUPS):
                group = (round_ + i) % GROUPS
                reply = http.post("/v1/completions", json={"model": model, "max_tokens": 2, "temperature": 0,
                                                           "prompt": f"{openings[group]}\nQuestion {round_}: why?"})
                assert reply.status_code == 200, reply.text


def test_cache_aware_routing_keeps_prefixes_where_they_are_cached(replicas, tiny_model_dir, tmp_path):
    urls = [replica["url"] for replica in replicas]
    rates = {}
    for seed, policy in enumerate(("round_robin", "cache_aware")):
        with running_smg(urls, tmp_path / f"smg-{policy}.log", policy) as router:
            rates[policy] = hit_rate(replicas, lambda: send_groups(router, Path(tiny_model_dir).name, prefixes(seed)))
    assert rates["cache_aware"] >= 0.75, rates
    assert rates["cache_aware"] >= 1.7 * rates["round_robin"], rates


def finished(replicas: list[dict]) -> list[int]:
    counts = []
    for replica in replicas:
        with Client(replica["address"]) as client:
            counts.append(client.stats().requests_finished)
    return counts


async def send_all_at_once(url: str, model: str, prompts: list[str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        replies = await asyncio.gather(*(http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}) for prompt in prompts))
    assert all(reply.status_code == 200 for reply in replies), [r.text for r in replies if r.status_code != 200]


def test_cache_aware_routing_spreads_a_burst_of_unrelated_prompts_evenly(replicas, tiny_model_dir, tmp_path):
    decode = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json")).decode
    prompts = [decode(request.prompt) for request in make_requests(40, (16, 64), (2, 2), seed=36)]
    before = finished(replicas)
    with running_smg([replica["url"] for replica in replicas], tmp_path / "smg-burst.log", "cache_aware") as router:
        asyncio.run(send_all_at_once(router, Path(tiny_model_dir).name, prompts))
    served = [after - earlier for after, earlier in zip(finished(replicas), before)]
    assert sum(served) == len(prompts), served
    assert all(0.4 * len(prompts) <= count <= 0.6 * len(prompts) for count in served), served


@contextlib.contextmanager
def kept_busy(url: str, streams: int = 8):
    """`streams` requests sent to the replica directly, again as each ends, until the block ends: long
    prompts (their KV fills most of the pool) and short outputs (the block ends soon after)."""
    done = threading.Event()
    prompt = "Count slowly: " + "one two three four five " * 80

    def generate() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while not done.is_set():
                http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 60, "ignore_eos": True})

    threads = [threading.Thread(target=generate, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)


def test_load_aware_routing_sends_new_requests_to_the_idle_replica(replicas, tiny_model_dir, tmp_path):
    busy, idle = replicas
    probe = "Say one word."
    with Client(idle["address"]) as client:
        probe_tokens = len(client.tokenize(probe))
        before = client.stats().prompt_tokens_total
    with running_smg([busy["url"], idle["url"]], tmp_path / "smg-least-load.log", "least_load",
                     # the probes' size (SMG's HTTP path cannot count a request's tokens)
                     "--least-load-mean-prefill-tokens", "16") as router, kept_busy(busy["url"]):
        with httpx.Client(base_url=router, timeout=60) as http:
            wait_until_reported_busy(http, busy["url"])
            for _ in range(20):
                reply = http.post("/v1/completions", json={"model": Path(tiny_model_dir).name, "prompt": probe,
                                                           "max_tokens": 1})
                assert reply.status_code == 200, reply.text
    with Client(idle["address"]) as client:
        on_idle = (client.stats().prompt_tokens_total - before) / probe_tokens
    assert on_idle >= 0.9 * 20, on_idle


def wait_until_reported_busy(http: httpx.Client, busy_url: str, timeout: float = 30) -> None:
    """Until the busy replica's /v1/loads shows its KV in use, as SMG reads it, and SMG's load monitor
    (polling every second, nanoserve_cli/router.py) has fed that to its policy."""
    deadline = time.monotonic() + timeout
    while True:
        loads = {row["worker"]: row for row in http.get("/get_loads").json()["loads"]}
        if loads.get(busy_url, {}).get("token_usage", 0) > 0:
            time.sleep(2.5)
            return
        assert time.monotonic() < deadline, f"SMG never saw {busy_url} busy: {loads}"
        time.sleep(0.2)
