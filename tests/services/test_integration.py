"""The services end to end: real worker and scheduler processes on loopback, a real gRPC client."""
import json
import math
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve.client import Client
from tests.services.processes import REPO, running_service

NUM_KV_BLOCKS = 200
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("svc") / "services.log"
    flags = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "32")
    with running_service(Path(tiny_model_dir), log, worker_flags=flags) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service):
    with Client(service["address"]) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_text_prompt_greedy_matches_transformers(client, hf):
    text = "The quick brown fox jumps over the lazy dog."
    ids = hf[1](text)["input_ids"]
    assert client.tokenize(text) == ids
    got = client.generate(text, max_tokens=24, temperature=0, ignore_eos=True)
    assert got.token_ids == hf_greedy(hf, ids, 24)
    assert got.finish_reason == "FINISH_REASON_LENGTH"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 24)


def test_token_id_prompt_greedy_matches_transformers(client, hf):
    ids = [(i * 7919) % 150000 for i in range(1, 40)]
    got = client.generate(ids, max_tokens=20, temperature=0, ignore_eos=True)
    assert got.token_ids == hf_greedy(hf, ids, 20)
    assert got.text == hf[1].decode(got.token_ids, skip_special_tokens=True)


def test_a_prompt_arriving_mid_decode_joins_a_mixed_step_and_both_match_transformers(client, hf):
    """Chunked prefill (the default): a prompt admitted while another request decodes is computed in
    the decode's step, not in a step of its own (GetStats counts a mixed step), and both requests
    still get transformers' greedy tokens."""
    decoding, arriving = list(range(300, 340)), list(range(500, 537))
    before = client.stats()
    stream = client.stream(decoding, max_tokens=100, temperature=0, ignore_eos=True)  # ~100 steps to join
    tokens = list(next(stream).token_ids)  # it is decoding now
    with ThreadPoolExecutor(1) as pool:
        arrived = pool.submit(client.generate, arriving, max_tokens=12, temperature=0, ignore_eos=True)
        tokens += [token for msg in stream for token in msg.token_ids]
        assert arrived.result().token_ids == hf_greedy(hf, arriving, 12)
    after = client.stats()
    assert tokens == hf_greedy(hf, decoding, 100)
    assert after.mixed_steps > before.mixed_steps and after.mixed_decode_tokens > before.mixed_decode_tokens


def test_concurrent_streams_with_shared_prefix(client):
    prefix = [(i * 31 + 5) % 140000 for i in range(4 * BLOCK_SIZE)]
    prompts = [prefix + [1000 + i, 2000 + i] if i % 2 == 0 else [(i * 97 + j) % 140000 for j in range(20 + i)]
               for i in range(64)]
    lengths = [4 + i % 13 for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda a: client.generate(a[0], max_tokens=a[1], temperature=0.8, seed=a[2],
                                                          ignore_eos=True), zip(prompts, lengths, range(64))))
    for i, (res, n) in enumerate(zip(results, lengths)):
        assert len(res.token_ids) == n == res.usage.completion_tokens
        assert res.finish_reason == "FINISH_REASON_LENGTH"
    shared_cached = [r.usage.cached_prompt_tokens for r in results[0::2]]
    assert sum(c > 0 for c in shared_cached) >= 16, shared_cached
    assert all(c % BLOCK_SIZE == 0 and c <= len(prefix) for c in shared_cached)
    stats = client.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == NUM_KV_BLOCKS
    assert stats.num_running == stats.num_waiting == 0


def wait_all_blocks_free(client, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held after cancel: {client.stats()}")


def test_cancelled_stream_frees_its_blocks(client):
    stream = client.stream(list(range(100, 180)), max_tokens=3000, temperature=0, ignore_eos=True)
    received = 0
    for msg in stream:
        received += len(msg.token_ids)
        if received >= 5:
            break
    assert client.stats().num_running == 1
    stream.cancel()
    wait_all_blocks_free(client)


def test_streamed_text_equals_decoding_of_all_tokens(client, hf):
    found_multibyte = False
    for seed in range(8):
        pieces, tokens = [], []
        for msg in client.stream("写一首关于大海的诗 🌊", max_tokens=48, temperature=1.0, seed=seed, ignore_eos=True):
            pieces.append(msg.text)
            tokens.extend(msg.token_ids)
        full = hf[1].decode(tokens, skip_special_tokens=True)
        assert "".join(pieces) == full
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in full
        found_multibyte |= any(ord(ch) > 0x7FF for ch in full)
    assert found_multibyte, "no multi-byte character was generated; the test proves nothing"


def expect_error(client, code: grpc.StatusCode, fragment: str, prompt, **kwargs) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt, **kwargs)
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()


def test_bad_requests_get_clear_errors(client):
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    expect_error(client, INVALID, "empty", "")
    expect_error(client, INVALID, "empty", [])
    expect_error(client, INVALID, "outside the vocabulary", [1, 2, 10_000_000])
    expect_error(client, INVALID, "max_tokens", [1, 2, 3], max_tokens=0)
    expect_error(client, INVALID, "temperature", [1, 2, 3], temperature=-0.5)
    expect_error(client, INVALID, "temperature", [1, 2, 3], temperature=math.nan)
    limit = client.model_info().max_model_len
    expect_error(client, INVALID, "length limit", [5] * (limit + 1))
    # The model's 4096 tokens are capped to what one sequence can hold in the pool, so a prompt
    # larger than the pool is over the limit (the scheduler's RESOURCE_EXHAUSTED guard behind it
    # is tested in tests/scheduler/test_scheduler_edges.py).
    pool_tokens = NUM_KV_BLOCKS * BLOCK_SIZE
    assert limit == pool_tokens
    expect_error(client, INVALID, "length limit", [5] * (pool_tokens + 100))
    expect_error(client, INVALID, "ask for at most 10 tokens", [5] * (limit - 10), max_tokens=11)


def test_bad_requests_do_not_disturb_good_ones(client):
    prompts = [[(i * 13 + j) % 9000 for j in range(30)] for i in range(6)]
    alone = [client.generate(p, max_tokens=12, temperature=0.7, seed=i, ignore_eos=True).token_ids
             for i, p in enumerate(prompts)]
    bad = [dict(prompt=[]), dict(prompt=[1, 10_000_000]), dict(prompt=[1], max_tokens=0),
           dict(prompt=[1], temperature=-1.0)]

    def run(i):
        if i % 2:
            with pytest.raises(grpc.RpcError):
                client.generate(**bad[(i // 2) % len(bad)])
            return None
        return client.generate(prompts[i // 2], max_tokens=12, temperature=0.7, seed=i // 2, ignore_eos=True).token_ids

    with ThreadPoolExecutor(12) as pool:
        mixed = [r for r in pool.map(run, range(12)) if r is not None]
    assert mixed == alone


def test_node_client_streams_a_generate(service, client):
    node = shutil.which("node")
    if node is None or not (REPO / "tests/services/node/node_modules").exists():
        pytest.skip("node or tests/services/node/node_modules missing (make install provides them)")
    out = subprocess.run([node, str(REPO / "tests/services/node/generate.mjs"), service["address"]], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    again = client.generate(result["prompt_token_ids"], max_tokens=len(result["token_ids"]), temperature=0,
                            ignore_eos=True)
    assert result["token_ids"] == again.token_ids
    assert result["text"] == again.text


def test_reflection_and_health_are_served(service):
    with grpc.insecure_channel(service["address"]) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"nanoserve.v1.LLM", "grpc.health.v1.Health"} <= set(services)
