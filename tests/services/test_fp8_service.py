"""A worker started with --kv-cache-dtype fp8 (on CPU: e4m3 storage through the torch reference),
served end to end: the model info reports the cache dtype, a repeated prompt hits the prefix
cache, and requests that outgrow the KV pool are preempted and recomputed without changing their
greedy tokens."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nanoserve.client import Client
from tests.services.processes import running_service

BLOCK_SIZE, NUM_KV_BLOCKS, MAX_MODEL_LEN = 16, 12, 128


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fp8") / "services.log"
    engine = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8")
    worker = ("--kv-cache-dtype", "fp8", "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS))
    with running_service(Path(tiny_model_dir), log, worker_flags=engine + worker, scheduler_flags=engine) as svc:
        with Client(svc["address"]) as c:
            yield c


def test_model_info_reports_the_fp8_cache(client):
    info = client.model_info()
    assert (info.kv_cache_dtype, info.dtype, info.num_kv_blocks) == ("float8_e4m3fn", "float32", NUM_KV_BLOCKS)


def test_prefix_hits_and_preemption_keep_the_greedy_tokens(client):
    """Alone, each prompt runs undisturbed; together the four need 20 blocks of the 12, so some are
    preempted and recomputed, from an FP8 cache, and must still produce the same tokens."""
    prompts = [[(i * 7919 + j * 31) % 140000 for j in range(20)] for i in range(4)]
    greedy = dict(max_tokens=60, temperature=0, ignore_eos=True)
    alone = [client.generate(prompt, **greedy).token_ids for prompt in prompts]
    again = client.generate(prompts[-1], **greedy)  # its blocks are still cached
    assert again.token_ids == alone[-1] and again.usage.cached_prompt_tokens == BLOCK_SIZE
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda prompt: client.generate(prompt, **greedy).token_ids, prompts))
    assert together == alone
    stats = client.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == NUM_KV_BLOCKS
