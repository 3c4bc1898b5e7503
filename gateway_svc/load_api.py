"""What a router asks a replica besides its metrics: its load and what it serves.

`GET /get_load` answers {"load": running + waiting} (sglang-router's power-of-two asks it);
`GET /v1/loads` answers SMG's WorkerLoadResponse (one data-parallel rank: this replica), which SMG
polls for its load-aware policies. SMG tells engines apart by /v1/models' owned_by, then by vLLM's
/version and SGLang's /server_info: nanoserve answers /server_info and /model_info (and their older
/get_ names) in SGLang's shape, so SMG registers it as an SGLang-like HTTP worker and polls /v1/loads.
Every value comes from one GetStats (and the ModelInfo) of the scheduler.
"""
import datetime
from collections.abc import Callable

from fastapi import FastAPI

from gateway_svc.engine_metrics import kv_cache_usage
from gateway_svc.scheduler_client import SchedulerClient, model_names
from nanoserve import __version__
from nanoserve.v1 import llm_pb2


def worker_load(stats: llm_pb2.Stats, block_size: int) -> dict:
    """One rank's SchedulerLoadSnapshot (SMG's names); what nanoserve does not track stays out."""
    used_blocks = stats.kv_blocks_total - stats.kv_blocks_free
    return {"dp_rank": 0, "num_running_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting,
            "num_total_reqs": stats.num_running + stats.num_waiting, "num_used_tokens": used_blocks * block_size,
            "max_total_num_tokens": stats.kv_blocks_total * block_size, "token_usage": kv_cache_usage(stats),
            "cache_hit_rate": (stats.prefix_cache_hit_tokens / stats.prompt_tokens_total
                               if stats.prompt_tokens_total else 0.0)}


def add_load_routes(app: FastAPI, client: Callable[[], SchedulerClient], served_model_name: str) -> None:
    @app.get("/get_load")
    async def get_load():
        stats = await client().stats()
        return {"load": stats.num_running + stats.num_waiting}

    @app.get("/v1/loads")
    async def loads():  # SMG's ?include= sections: all nanoserve has is in the core one, always sent
        stats = await client().stats()
        info = await client().model_info()
        return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "dp_rank_count": 1,
                "loads": [worker_load(stats, info.block_size)]}

    async def server_info():
        info = await client().model_info()
        return {"model_path": info.model, "served_model_name": model_names(info, served_model_name)[0],
                "tp_size": info.tensor_parallel_size, "dp_size": 1, "context_length": info.max_model_len,
                "max_total_tokens": info.num_kv_blocks * info.block_size, "page_size": info.block_size,
                "kv_cache_dtype": info.kv_cache_dtype, "is_embedding": False, "engine": "nanoserve",
                "version": __version__}

    async def model_info():
        info = await client().model_info()
        return {"model_path": info.model, "tokenizer_path": info.model, "is_generation": True,
                "has_image_understanding": False, "has_audio_understanding": False}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
