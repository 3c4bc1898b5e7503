"""The llm-d engine configuration names metrics the gateway really serves, with the labels it reads
(checked against the gateway's own exposition, parsed by prometheus_client)."""
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway_svc.engine_metrics import engine_families, text_format
from nanoserve.v1 import llm_pb2

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "llm-d" / "nanoserve-engine.yaml"


def served_families() -> dict:
    stats = llm_pb2.Stats(num_waiting=3, num_running=2, kv_blocks_total=10, kv_blocks_free=4)
    exposition = text_format(engine_families(stats, 256, "bfloat16", "m", vllm_names=False)).decode()
    return {f.name: f for f in text_string_to_metric_families(exposition)}


def test_engine_config_reads_the_gateways_metrics():
    plugin = yaml.safe_load(CONFIG.read_text())
    assert plugin["type"] == "core-metrics-extractor"
    assert plugin["parameters"]["engineLabelKey"] == "llm-d.ai/engine-type"
    [engine] = plugin["parameters"]["engineConfigs"]
    assert engine["name"] == "nanoserve"
    families = served_families()
    values = {spec: families[engine[spec]].samples[0].value
              for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")}
    assert values == {"queuedRequestsSpec": 3, "runningRequestsSpec": 2, "kvUsageSpec": 0.6}
    info = families[engine["cacheInfoSpec"]]
    assert info.type == "gauge"
    labels = info.samples[0].labels
    assert labels[engine["cacheBlockSizeLabelName"]] == "256" and labels[engine["cacheNumBlocksLabelName"]] == "10"
