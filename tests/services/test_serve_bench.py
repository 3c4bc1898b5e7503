"""bench/serve.py, the online benchmark (issue 15): its workload and per-request measurement against
scripted streams, and a smoke run through the public gRPC API of real processes on the tiny model."""
import asyncio
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.processes import ENV, REPO, running_service

_spec = importlib.util.spec_from_file_location("bench_serve", REPO / "bench" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)


class ScriptedTarget:
    """Streams messages of the given token counts, each `gap` seconds of a fake clock after the one before."""

    def __init__(self, counts: list[int], clock: list[float], gap: float, fail_after: int | None = None):
        self.counts, self.clock, self.gap, self.fail_after = counts, clock, gap, fail_after

    async def stream(self, request):
        for index, count in enumerate(self.counts):
            if index == self.fail_after:
                raise serve.RequestFailed("UNAVAILABLE: the worker went away")
            self.clock[0] += self.gap
            yield count

    async def stats(self):
        return {}


def measure(target: ScriptedTarget, clock: list[float]) -> "serve.RequestResult":
    return asyncio.run(serve.run_request(target, serve.BenchRequest([1, 2, 3], 5), clock=lambda: clock[0]))


def test_requests_draw_lengths_from_their_ranges_behind_the_shared_prefix():
    requests = serve.make_requests(200, (10, 20), (3, 7), shared_prefix_len=32, seed=1)
    assert requests == serve.make_requests(200, (10, 20), (3, 7), shared_prefix_len=32, seed=1)
    prefix = requests[0].prompt[:32]
    assert all(r.prompt[:32] == prefix and 42 <= len(r.prompt) <= 52 and 3 <= r.max_tokens <= 7 for r in requests)
    assert {len(r.prompt) for r in requests} == set(range(42, 53)) and {r.max_tokens for r in requests} == {3, 4, 5, 6, 7}
    assert len({tuple(r.prompt[32:]) for r in requests}) == 200
    assert serve.make_requests(5, (10, 20), (3, 7), seed=2) != serve.make_requests(5, (10, 20), (3, 7), seed=1)


def test_tenants_share_a_system_prompt_each_and_come_in_mixed_order():
    requests = serve.make_tenant_requests(5, 4, 64, (8, 12), (3, 3), seed=1)
    assert requests == serve.make_tenant_requests(5, 4, 64, (8, 12), (3, 3), seed=1)
    systems = {}
    for r in requests:
        systems.setdefault(tuple(r.prompt[:64]), []).append(r)
    assert len(systems) == 5 and all(len(users) == 4 for users in systems.values())
    assert all(72 <= len(r.prompt) <= 76 and r.max_tokens == 3 for r in requests)
    assert len({tuple(r.prompt[64:]) for r in requests}) == 20  # every user asks their own question
    order = [tuple(r.prompt[:64]) for r in requests]
    assert order != sorted(order, key=list(systems).index)  # not tenant after tenant


def test_tenants_ask_once_a_round_and_keep_their_system_prompts_across_question_seeds():
    requests = serve.make_tenant_requests(5, 4, 64, (8, 12), (3, 3), seed=1, rounds=3)
    systems = [tuple(r.prompt[:64]) for r in requests]
    assert len(requests) == 60 and len(set(systems)) == 5
    for start in (0, 20, 40):  # each round: every tenant's 4 users once
        assert all(systems[start:start + 20].count(system) == 4 for system in set(systems))
    assert len({tuple(r.prompt[64:]) for r in requests}) == 60
    other = serve.make_tenant_requests(5, 4, 64, (8, 12), (3, 3), seed=1, rounds=3, question_seed=7)
    assert {tuple(r.prompt[:64]) for r in other} == set(systems)
    assert not {tuple(r.prompt[64:]) for r in other} & {tuple(r.prompt[64:]) for r in requests}


def test_arrivals_are_a_poisson_process_or_all_at_once():
    assert serve.arrival_times(4, math.inf) == [0.0] * 4
    times = serve.arrival_times(4000, 20.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: the deviation is the mean


def test_a_request_is_timed_message_by_message():
    clock = [100.0]
    # messages of 1, 2 (two tokens at once), 0 (a last message with only the finish reason) and 1 tokens
    result = measure(ScriptedTarget([1, 2, 0, 1], clock, gap=0.5), clock)
    assert (result.ttft, result.e2e, result.output_tokens, result.error) == (0.5, 2.0, 4, "")
    assert result.itl == [0.25, 0.25, 1.0]
    assert result.tpot == pytest.approx(1.5 / 3)


def test_a_failed_request_is_recorded_not_raised():
    clock = [0.0]
    result = measure(ScriptedTarget([1, 1, 1], clock, gap=0.1, fail_after=2), clock)
    assert result.error == "UNAVAILABLE: the worker went away" and result.e2e is None and result.output_tokens == 2


def test_several_gateways_are_driven_by_the_client_processes_in_turn():
    """--openai URL,URL (replicas with no router in front): client process i drives URL i mod 2, and a
    client count that would favour one of them is refused."""
    args = serve.parse_args(["--openai", "http://127.0.0.1:8001,http://127.0.0.1:8002", "--client-processes", "4"])
    urls = [serve.open_target(args, "", "openai", process).url for process in range(4)]
    assert urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"] * 2
    with pytest.raises(SystemExit):
        serve.parse_args(["--openai", "http://127.0.0.1:8001,http://127.0.0.1:8002", "--client-processes", "3"])


def test_summary_counts_goodput_within_the_slo():
    def result(ttft: float, tpot: float, tokens: int = 11) -> "serve.RequestResult":
        return serve.RequestResult(100, tokens, ttft, [tpot] * (tokens - 1), ttft + tpot * (tokens - 1))

    results = [result(0.1, 0.02), result(0.3, 0.02), result(0.1, 0.03), result(0.05, 0.0, tokens=1),
               serve.RequestResult(100, error="RESOURCE_EXHAUSTED: queue full")]
    summary = serve.summarize(results, seconds=2.0, slo_ttft=0.2, slo_tpot=0.025)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (4, 1, ["RESOURCE_EXHAUSTED: queue full"])
    assert summary["goodput_req_per_s"] == 1.0  # the first and the one-token request
    assert summary["request_throughput"] == 2.0 and summary["output_tok_per_s"] == 34 / 2
    assert summary["ttft_ms"]["p50"] == pytest.approx(100) and summary["tpot_ms"]["n"] == 3
    assert summary["itl_ms"]["n"] == 30 and summary["e2e_ms"]["p99"] == pytest.approx(500)


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    """A worker and its scheduler for the smoke runs: the benchmark reports each rate by the server's counters
    before and after it, so a run's figures hold whatever an earlier run sent."""
    log = tmp_path_factory.mktemp("serve") / "services.log"
    flags = ("--block-size", "16", "--num-kv-blocks", "200")
    with running_service(Path(tiny_model_dir), log, worker_flags=flags) as svc:
        yield svc, log


def test_smoke_run_through_the_grpc_api(service, tmp_path):
    """Two rates (one all at once) against real processes: every request completes with exactly its
    drawn output length (eos ignored), the report holds each metric, and the server's counters moved."""
    svc, _ = service
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "serve.py"), "--address", svc["address"],
                          "--num-prompts", "6", "--request-rates", "20", "inf", "--input-len", "4", "24",
                          "--output-len", "2", "8", "--warmup", "1", "--out", str(out)],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["rates"]) == ["20", "inf"] and report["attention_backend"] == "torch"
    for index, summary in enumerate(report["rates"].values()):
        drawn = serve.make_requests(6, (4, 24), (2, 8), seed=index)
        assert (summary["completed"], summary["failed"]) == (6, 0)
        assert summary["output_tokens"] == sum(r.max_tokens for r in drawn)
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            row = summary[metric]
            assert 0 < row["p50"] <= row["p90"] <= row["p99"], metric
        assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]
        assert summary["server_steps"]["prefill_tokens"] >= sum(len(r.prompt) for r in drawn) - 16
        assert 0 <= summary["goodput_req_per_s"] <= summary["request_throughput"]
    assert "inf" in run.stdout and "TTFT" in run.stdout


def test_smoke_run_through_the_gateway_beside_grpc_from_two_client_processes(service, tmp_path):
    """--openai URL --compare-grpc --client-processes 2 against real processes (scheduler, worker,
    gateway), at a finite rate and all at once: the two client processes' results merge into every
    request, through both APIs, with exactly its drawn output length (counted from each event's token
    ids), the replica (--replicas) counts each once, each process reports the CPU seconds it spent,
    and the report compares the two APIs."""
    from tests.gateway.gateway_process import running_gateway

    svc, log = service
    with running_gateway(svc["address"], log) as url:
        out = tmp_path / "serve.json"
        run = subprocess.run([sys.executable, str(REPO / "bench" / "serve.py"), "--openai", url, "--address",
                              svc["address"], "--replicas", svc["address"], "--compare-grpc", "--num-prompts", "5",
                              "--request-rates", "40", "inf", "--client-processes", "2",
                              "--input-len", "4", "24", "--output-len", "2", "8", "--warmup", "1", "--out", str(out)],
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["api"] == "openai" and report["openai"] == url and report["client_processes"] == 2
    for rates in (report["rates"], report["grpc_rates"]):
        for index, summary in enumerate(rates.values()):
            drawn = serve.make_requests(5, (4, 24), (2, 8), seed=index)
            assert (summary["completed"], summary["failed"]) == (5, 0)
            assert summary["output_tokens"] == sum(r.max_tokens for r in drawn)
            assert summary["server_steps"]["prefill_tokens"] >= sum(len(r.prompt) for r in drawn) - 16
            assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]
            assert summary["ttft_ms"]["n"] == summary["e2e_ms"]["n"] == 5 <= summary["stream_messages"]
            assert summary["requests_per_replica"] == [5]  # the warm-up's request not counted
            client = summary["client"]
            assert client["processes"] == 2 and len(client["cpu_seconds"]) == len(client["cpu_per_wall"]) == 2
            assert all(cpu > 0 for cpu in client["cpu_seconds"])
            assert all(0 < share < 2 for share in client["cpu_per_wall"])
    assert report["openai_vs_grpc"]["inf"]["output_tok_per_s_ratio"] > 0


def test_null_worker_run_starts_its_own_scheduler_and_gateway(tmp_path):
    """--null-worker --openai --compare-grpc: a scheduler over a worker that computes nothing and a
    gateway in front of it, both started by the benchmark; every request completes through both APIs
    with its drawn output length, and the processes are gone afterwards."""
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "serve.py"), "--null-worker", "--openai", "--compare-grpc",
                          "--num-prompts", "4", "--request-rates", "inf", "--input-len", "4", "24",
                          "--output-len", "2", "8", "--warmup", "1", "--out", str(out)],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    drawn = serve.make_requests(4, (4, 24), (2, 8), seed=0)
    assert report["api"] == "openai" and report["attention_backend"] == "none"
    for rates in (report["rates"], report["grpc_rates"]):
        assert (rates["inf"]["completed"], rates["inf"]["failed"]) == (4, 0)
        assert rates["inf"]["output_tokens"] == sum(r.max_tokens for r in drawn)
