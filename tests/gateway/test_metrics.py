"""Prometheus metrics read with prometheus_client's own parser: the scheduler's counters move by
exactly what known requests did, and the gateway counts its HTTP requests."""
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.client import Client
from tests.gateway.conftest import NUM_KV_BLOCKS
from tests.services.processes import free_port, running_service


def scrape(url: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(url, timeout=10).text) for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_until(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_scheduler_counters_move_by_known_requests(service, grpc_client):
    url = service["metrics_url"]
    prompt = [(i * 13 + 3) % 140000 for i in range(53)]  # 3 full blocks of 16 and a partial one
    greedy = grpc_client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids
    stop_at = next(i for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2)
    before = scrape(url)
    results = [grpc_client.generate(prompt, max_tokens=7, temperature=0, ignore_eos=True, request_id="metrics-a"),
               grpc_client.generate(prompt + [5, 6], max_tokens=5, temperature=0, ignore_eos=True),
               grpc_client.generate(prompt, max_tokens=8, temperature=0, stop_token_ids=(greedy[stop_at],))]
    after = scrape(url)

    assert [r.finish_reason for r in results] == ["FINISH_REASON_LENGTH"] * 2 + ["FINISH_REASON_STOP"]
    assert results[2].usage.completion_tokens == stop_at + 1
    cached = [r.usage.cached_prompt_tokens for r in results]
    assert cached == [48, 48, 48]  # the first generate above left the prompt's full blocks cached
    assert delta(before, after, "nanoserve_prompt_tokens_total") == 53 + 55 + 53
    assert delta(before, after, "nanoserve_generation_tokens_total") == 7 + 5 + stop_at + 1
    assert delta(before, after, "nanoserve_prefix_cache_hit_tokens_total") == sum(cached)
    assert delta(before, after, "nanoserve_requests_finished_total", finish_reason="length") == 2
    assert delta(before, after, "nanoserve_requests_finished_total", finish_reason="stop") == 1
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "time_per_output_token"):
        assert delta(before, after, f"nanoserve_{histogram}_seconds_count") == 3, histogram
        assert delta(before, after, f"nanoserve_{histogram}_seconds_sum") > 0, histogram
    assert after[("nanoserve_kv_blocks_total", ())] == NUM_KV_BLOCKS
    for idle in ("nanoserve_kv_blocks_used", "nanoserve_num_requests_running", "nanoserve_num_requests_waiting",
                 "nanoserve_steps_in_flight", "nanoserve_preemptions_total", "nanoserve_worker_failures_total"):
        assert after[(idle, ())] == 0, idle

    line = next(line for line in service["log"].read_text().splitlines() if "request finished id=metrics-a " in line)
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    assert (fields["prompt_tokens"], fields["completion_tokens"], fields["cached_tokens"]) == ("53", "7", "48")
    assert fields["finish_reason"] == "length" and float(fields["ttft"].rstrip("s")) > 0
    assert float(fields["duration"].rstrip("s")) >= float(fields["ttft"].rstrip("s"))


def test_a_cancelled_request_counts_as_aborted_and_frees_its_blocks(service, grpc_client):
    url = service["metrics_url"]
    before = scrape(url)
    stream = grpc_client.stream([1, 2, 3], max_tokens=3000, ignore_eos=True)
    next(stream)
    assert scrape(url)[("nanoserve_kv_blocks_used", ())] > 0
    stream.cancel()
    wait_until(lambda: delta(before, scrape(url), "nanoserve_requests_finished_total", finish_reason="abort") == 1)
    wait_until(lambda: scrape(url)[("nanoserve_kv_blocks_used", ())] == 0)


def test_gateway_counts_its_http_requests(gateway, oai, model_name):
    url = gateway + "/metrics"
    before = scrape(url)
    for _ in range(2):
        oai.completions.create(model=model_name, prompt="hi", max_tokens=2)
    httpx.post(gateway + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=10)
    after = scrape(url)
    ok = {"method": "POST", "path": "/v1/completions", "status": "200"}
    assert delta(before, after, "nanoserve_gateway_http_requests_total", **ok) == 2
    assert delta(before, after, "nanoserve_gateway_http_requests_total", **{**ok, "status": "404"}) == 1
    assert delta(before, after, "nanoserve_gateway_http_request_duration_seconds_count", method="POST",
                 path="/v1/completions") == 3


def test_preemptions_are_counted(tiny_model_dir, tmp_path):
    """Four sequences that outgrow a 10-block pool together: some are preempted and recomputed."""
    port = free_port()
    flags = ("--block-size", "16", "--num-kv-blocks", "10", "--max-num-seqs", "4")
    with running_service(Path(tiny_model_dir), tmp_path / "services.log", worker_flags=flags,
                         scheduler_flags=("--metrics-port", str(port))) as svc:
        with Client(svc["address"]) as client, ThreadPoolExecutor(4) as pool:
            prompts = [[(i * 17 + j) % 140000 for j in range(20)] for i in range(4)]
            results = list(pool.map(lambda p: client.generate(p, max_tokens=60, temperature=0, ignore_eos=True),
                                    prompts))
        assert [r.usage.completion_tokens for r in results] == [60] * 4
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        assert samples[("nanoserve_preemptions_total", ())] > 0
        assert samples[("nanoserve_requests_finished_total", (("finish_reason", "length"),))] == 4
