"""What routers read from a replica, against GetStats and the scheduler's own tokens: the model-server
metrics through prometheus_client's parser, the load endpoints in SMG's shapes, the server and model
info SMG identifies an engine by, and vLLM's render endpoints."""
import contextlib
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.routers.conftest import BLOCK_SIZE, MAX_NUM_SEQS, NUM_KV_BLOCKS

GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
LOAD_KEYS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
             "max_total_num_tokens", "token_usage", "cache_hit_rate"}


def scrape(url: str) -> dict:
    """name -> (type, [(labels, value)]) of every family /metrics serves."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return {f.name: (f.type, [(s.labels, s.value) for s in f.samples]) for f in families}


def gauges(stats) -> tuple:
    return stats.num_waiting, stats.num_running, stats.kv_blocks_free, stats.kv_blocks_total


@contextlib.contextmanager
def busy(grpc_client, count: int):
    """`count` long generations in flight (MAX_NUM_SEQS run, the rest wait), cancelled on the way out."""
    streams = [grpc_client.stream([7 + i, 8, 9, 10] * 10, max_tokens=300, ignore_eos=True) for i in range(count)]
    try:
        yield
    finally:
        for stream in streams:
            stream.cancel()
        with contextlib.suppress(grpc.RpcError):
            for stream in streams:
                list(stream)


def wait_for(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_metrics_and_loads_agree_with_getstats(replica, grpc_client, tiny_model_dir):
    url, model = replica["url"], Path(tiny_model_dir).name
    with busy(grpc_client, MAX_NUM_SEQS + 1):
        wait_for(lambda: gauges(grpc_client.stats())[:2] == (1, MAX_NUM_SEQS))
        for _ in range(200):  # decodes take blocks as they go: keep a round in which GetStats did not move
            before = grpc_client.stats()
            metrics, load = scrape(url), httpx.get(url + "/get_load").json()
            loads = httpx.get(url + "/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
            if gauges(grpc_client.stats()) == gauges(before):
                break
        else:
            pytest.fail("GetStats never held still for one round of scrapes")
    used = NUM_KV_BLOCKS - before.kv_blocks_free
    assert before.kv_blocks_total == NUM_KV_BLOCKS and used > 0
    usage = used / NUM_KV_BLOCKS
    expected = {"nanoserve_num_requests_waiting": 1, "nanoserve_num_requests_running": MAX_NUM_SEQS,
                "nanoserve_kv_cache_usage_perc": usage}
    for name, value in expected.items():
        assert metrics[name] == ("gauge", [({}, value)]), name
    vllm = {"vllm:num_requests_waiting": 1, "vllm:num_requests_running": MAX_NUM_SEQS,
            "vllm:kv_cache_usage_perc": usage, "vllm:gpu_cache_usage_perc": usage}
    for name, value in vllm.items():
        assert metrics[name] == ("gauge", [({"model_name": model}, value)]), name
    config = {"block_size": str(BLOCK_SIZE), "num_kv_blocks": str(NUM_KV_BLOCKS), "kv_cache_dtype": "float32"}
    assert metrics["nanoserve_cache_config_info"] == ("gauge", [(config, 1.0)])
    assert metrics["vllm:cache_config_info"] == ("gauge", [({"block_size": str(BLOCK_SIZE), "cache_dtype": "float32",
                                                              "num_gpu_blocks": str(NUM_KV_BLOCKS)}, 1.0)])

    assert load == {"load": MAX_NUM_SEQS + 1}
    assert set(loads) == {"timestamp", "dp_rank_count", "loads"} and loads["dp_rank_count"] == 1
    [snapshot] = loads["loads"]
    assert set(snapshot) == LOAD_KEYS
    assert (snapshot["num_running_reqs"], snapshot["num_waiting_reqs"], snapshot["num_total_reqs"]) == (2, 1, 3)
    assert snapshot["num_used_tokens"] == used * BLOCK_SIZE
    assert snapshot["max_total_num_tokens"] == NUM_KV_BLOCKS * BLOCK_SIZE
    assert snapshot["token_usage"] == usage

    wait_for(lambda: gauges(grpc_client.stats())[:2] == (0, 0))
    idle = scrape(url)
    assert idle["nanoserve_num_requests_running"] == ("gauge", [({}, 0.0)])
    assert idle["nanoserve_kv_cache_usage_perc"] == ("gauge", [({}, 0.0)])
    assert httpx.get(url + "/get_load").json() == {"load": 0}


def test_server_and_model_info_in_sglang_shape(replica, tiny_model_dir):
    url = replica["url"]
    info = httpx.get(url + "/server_info").json()
    assert info == httpx.get(url + "/get_server_info").json()
    assert info["model_path"] == str(tiny_model_dir) and info["served_model_name"] == Path(tiny_model_dir).name
    assert (info["tp_size"], info["dp_size"], info["engine"]) == (1, 1, "nanoserve")
    assert info["max_total_tokens"] == NUM_KV_BLOCKS * BLOCK_SIZE and info["page_size"] == BLOCK_SIZE
    model = httpx.get(url + "/model_info").json()
    assert model == httpx.get(url + "/get_model_info").json()
    assert model["model_path"] == str(tiny_model_dir) and model["is_generation"] is True


@pytest.fixture(scope="module")
def oai(replica) -> openai.OpenAI:
    with openai.OpenAI(base_url=replica["url"] + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def render(url: str, path: str, body: dict):
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_render_is_what_the_scheduler_prefills(replica, oai):
    url, prompt = replica["url"], "The sea is wide and the sky is"
    [entry] = render(url, "/v1/completions/render", {"prompt": prompt, "max_tokens": 6, "temperature": 0.5})
    assert set(entry) == GENERATE_REQUEST_KEYS
    assert entry["sampling_params"]["max_tokens"] == 6 and entry["sampling_params"]["temperature"] == 0.5
    assert (entry["features"], entry["stream"], entry["priority"]) == (None, False, 0)
    ids = entry["token_ids"]
    assert ids == httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    from_text = oai.completions.create(model=None, prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    from_ids = oai.completions.create(model=None, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert from_text.usage.prompt_tokens == from_ids.usage.prompt_tokens == len(ids)
    assert from_text.choices[0].token_ids == from_ids.choices[0].token_ids  # the same prefill, the same greedy tokens
    assert render(url, "/v1/completions/render", {"prompt": ids})[0]["token_ids"] == ids


def test_chat_render_is_what_the_scheduler_prefills(replica, oai):
    url = replica["url"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    kwargs = {"enable_thinking": False}
    entry = render(url, "/v1/chat/completions/render", {"messages": messages, "chat_template_kwargs": kwargs})
    assert set(entry) == GENERATE_REQUEST_KEYS
    ids = entry["token_ids"]
    tokenized = httpx.post(url + "/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs}).json()
    assert ids == tokenized["tokens"]
    chat = oai.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"chat_template_kwargs": kwargs, "return_token_ids": True})
    from_ids = oai.completions.create(model=None, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].token_ids == from_ids.choices[0].token_ids
    plain = render(url, "/v1/chat/completions/render", {"messages": messages})["token_ids"]
    assert plain != ids  # the template's variables change the prompt, and render follows them


def test_render_refuses_what_generation_refuses(replica):
    url = replica["url"]
    bad = httpx.post(url + "/v1/completions/render", json={"prompt": [1, 2, 10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions/render", json={"prompt": "x", "model": "other"}).status_code == 404
    assert httpx.post(url + "/v1/chat/completions/render", json={"messages": []}).status_code == 400
