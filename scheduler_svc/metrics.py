"""Prometheus metrics and the per-request log line of the scheduler.

Kept off the hot path: the engine's own totals, queue lengths and KV pool are read when
Prometheus scrapes (a collector, no work per step or token); the latency histograms are
observed once per finished request; the steps-in-flight gauge is set once per step. Served by
prometheus_client's HTTP server on its own thread at --metrics-port.
"""
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler_svc.request_stream import RequestStream, RequestTimer
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence
from scheduler_svc.step_plan import StepPlan
from scheduler_svc.step_totals import Totals

log = logging.getLogger("nanoserve.requests")

# Seconds; TTFT and end-to-end span a single fast token to a long generation behind a queue.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5,
                  1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort")


class SchedulerMetrics:
    """Every nanoserve_ metric of one scheduler process, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.scheduler: Scheduler | None = None  # read at scrape time; set once the workers are connected
        self.totals: Totals | None = None
        r = self.registry
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds",
                              "Arrival to the first generated token being sent", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.time_per_output_token = Histogram("nanoserve_time_per_output_token_seconds",
                                               "Mean time between a request's output tokens after the first",
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Arrival to the last token being sent",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("nanoserve_request_queue_time_seconds",
                                    "Arrival to the first step that computes the request",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("nanoserve_requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.worker_failures = Counter("nanoserve_worker_failures", "Worker group failures (a rank died or hung; "
                                       "the requests were held for a restarted group)", registry=r)
        self.worker_restarts = Counter("nanoserve_worker_group_restarts", "Worker groups connected again after a "
                                       "failure (the held requests resumed)", registry=r)
        self.recomputed_tokens = Counter("nanoserve_recomputed_tokens", "Tokens recomputed after a worker failure "
                                         "(prompt and output so far of every resumed request)", registry=r)
        self.steps_in_flight = Gauge("nanoserve_steps_in_flight", "Steps sent to the workers and not yet "
                                     "answered", registry=r)
        r.register(_EngineCollector(self))

    def watch(self, scheduler: Scheduler, totals: Totals) -> None:
        """The engine's queues, KV pool and counters, for the collector to read at scrape time."""
        self.scheduler, self.totals = scheduler, totals

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics over HTTP on a daemon thread."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise SystemExit(f"cannot serve metrics on {host}:{port} (--metrics-port): {err}") from None

    def step_sent(self, plan: StepPlan, streams: dict[int, RequestStream], steps_in_flight: int) -> None:
        """Stamps the requests this step computes for the first time. They are the batch's last
        entries (admissions join a step after the sequences already running, in queue order),
        so the walk from the end stops at the first request scheduled before: one look per
        decode step, whatever the batch size."""
        self.steps_in_flight.set(steps_in_flight)
        now = None
        for seq in reversed(plan.seqs):
            stream = streams.get(seq.seq_id)
            if stream is None:  # aborted meanwhile
                continue
            if stream.timer.scheduled is not None:
                break
            stream.timer.scheduled = now = now or time.monotonic()

    def worker_failure(self) -> None:
        self.worker_failures.inc()
        self.steps_in_flight.set(0)

    def group_restored(self, recomputed_tokens: int) -> None:
        self.worker_restarts.inc()
        self.recomputed_tokens.inc(recomputed_tokens)

    def request_finished(self, request_id: str, seq: Sequence, timer: RequestTimer) -> None:
        """Observes a request that ended with its last token (or was aborted) and logs its line."""
        now = time.monotonic()
        reason = seq.finish_reason or "abort"
        self.finished.labels(reason).inc()
        num_tokens = len(seq.completion_token_ids)
        if timer.scheduled is not None:
            self.queue_time.observe(timer.scheduled - timer.arrived)
        ttft = None if timer.first_token is None else timer.first_token - timer.arrived
        if ttft is not None and reason != "abort":
            self.ttft.observe(ttft)
            self.e2e.observe(now - timer.arrived)
            if num_tokens > 1:
                self.time_per_output_token.observe((now - timer.first_token) / (num_tokens - 1))
        log.info("request finished id=%s seq=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                 "ttft=%s duration=%.4fs finish_reason=%s", request_id or "-", seq.seq_id, seq.num_prompt_tokens,
                 num_tokens, seq.num_cached_prompt_tokens, "-" if ttft is None else f"{ttft:.4f}s",
                 now - timer.arrived, reason)


class _EngineCollector(Collector):
    """Gauges and token counters read from the engine's scheduler and totals when Prometheus scrapes.

    Runs on the HTTP server's thread: it only reads lengths and integers, which the engine
    replaces atomically, so a scrape may be a step stale but never inconsistent with itself.
    """

    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics

    def collect(self):
        scheduler, totals = self.metrics.scheduler, self.metrics.totals
        if scheduler is None or totals is None:
            return
        yield _gauge("nanoserve_num_requests_running", "Requests holding KV blocks", scheduler.num_running)
        yield _gauge("nanoserve_num_requests_waiting", "Requests queued for admission", scheduler.num_waiting)
        yield _gauge("nanoserve_kv_blocks_total", "KV cache blocks in the pool", scheduler.num_total_blocks)
        yield _gauge("nanoserve_kv_blocks_used", "KV cache blocks held by requests",
                     scheduler.num_total_blocks - scheduler.num_free_blocks)
        yield _counter("nanoserve_prompt_tokens", "Prompt tokens of admitted requests", totals.prompt_tokens)
        yield _counter("nanoserve_generation_tokens", "Tokens generated", totals.generated_tokens)
        yield _counter("nanoserve_prefix_cache_hit_tokens", "Tokens served from the prefix cache at admission",
                       scheduler.prefix_cache_hit_tokens)
        yield _counter("nanoserve_preemptions", "Running requests preempted for lack of KV blocks",
                       scheduler.num_preemptions)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
