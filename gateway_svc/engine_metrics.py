"""The model-server protocol's metrics, served on the gateway's /metrics: the port a router scrapes.

Routers (llm-d's endpoint picker, SMG, vllm-router) score a replica by its queue, its running
requests and its KV-cache use, and size their prefix indexes by its cache configuration (the
Gateway API Inference Extension's model-server protocol). Every value comes from one GetStats
answer of the scheduler, asked at scrape time, so a scrape never disagrees with GetStats; the
cache configuration adds ModelInfo's block size. nanoserve's names always; with
--vllm-metric-names also vLLM's, for routers that hard-code them (vLLM's gauges carry a
model_name label, and its KV gauge has an older name too).
"""
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway_svc.errors import OpenAIError
from gateway_svc.scheduler_client import SchedulerClient, model_names
from nanoserve.v1 import llm_pb2


def kv_cache_usage(stats: llm_pb2.Stats) -> float:
    """The fraction of KV blocks held by requests (0-1); cached blocks on the free list count as free."""
    total = stats.kv_blocks_total
    return (total - stats.kv_blocks_free) / total if total else 0.0


def engine_families(stats: llm_pb2.Stats, block_size: int, kv_cache_dtype: str, model_name: str,
                    vllm_names: bool) -> list[Metric]:
    """The protocol's gauges under nanoserve's names and, when asked, vLLM's."""
    usage = kv_cache_usage(stats)
    families = [
        _gauge("nanoserve_num_requests_waiting", "Requests queued for admission", stats.num_waiting),
        _gauge("nanoserve_num_requests_running", "Requests holding KV blocks", stats.num_running),
        _gauge("nanoserve_kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (1 = all)", usage),
        _info("nanoserve_cache_config_info", "KV cache configuration",
              {"block_size": str(block_size), "num_kv_blocks": str(stats.kv_blocks_total),
               "kv_cache_dtype": kv_cache_dtype}),
    ]
    if vllm_names:
        model = {"model_name": model_name}
        families += [
            _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting,
                   model),
            _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running,
                   model),
            _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage, model),
            _gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage (vLLM's older "
                   "name).", usage, model),
            _info("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                  {"block_size": str(block_size), "num_gpu_blocks": str(stats.kv_blocks_total),
                   "cache_dtype": kv_cache_dtype}),
        ]
    return families


async def engine_exposition(client: SchedulerClient, served_model_name: str, vllm_names: bool) -> bytes:
    """The protocol's metrics in Prometheus' text format; nothing while the scheduler does not answer
    (a router then sees no load rather than a made-up idle one)."""
    try:
        stats = await client.stats()
        info = await client.model_info()
    except OpenAIError:
        return b""
    model_name = model_names(info, served_model_name)[0]
    return text_format(engine_families(stats, info.block_size, info.kv_cache_dtype or "auto", model_name, vllm_names))


def text_format(families: list[Metric]) -> bytes:
    """Families computed already, in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry)


class _Snapshot(Collector):
    """Metric families computed already."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def _gauge(name: str, documentation: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _info(name: str, documentation: str, labels: dict[str, str]) -> GaugeMetricFamily:
    """An info gauge as vLLM writes it: a gauge of 1 whose labels carry the values."""
    return _gauge(name, documentation, 1.0, labels)
