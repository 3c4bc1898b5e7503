"""The gateway's one connection to the scheduler: a single grpc.aio channel for every request."""
import asyncio
import logging
import os
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.errors import OpenAIError, from_grpc
from nanoserve.v1 import llm_pb2, llm_pb2_grpc
from nanoserve.wire import GRPC_OPTIONS

_SERVING = health_pb2.HealthCheckResponse.SERVING
# A scheduler that (re)starts is seen within a second: gRPC's default reconnect backoff grows to minutes.
_CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.max_reconnect_backoff_ms", 1000)]
log = logging.getLogger("nanoserve.gateway")


class SchedulerClient:
    """Opened inside the server's event loop (a grpc.aio channel is bound to the loop that made it)."""

    def __init__(self, address: str, rpc_timeout: float = 10.0):
        self.address = address
        self.rpc_timeout = rpc_timeout  # for the short calls; Generate runs as long as it generates
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.llm = llm_pb2_grpc.LLMStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._info: llm_pb2.ModelInfo | None = None

    async def close(self) -> None:
        await self.channel.close()

    async def model_info(self) -> llm_pb2.ModelInfo:
        """The served model, asked once (a scheduler serves one model for its lifetime)."""
        if self._info is None:
            self._info = await self._call(self.llm.GetModelInfo, llm_pb2.GetModelInfoRequest())
        return self._info

    async def stats(self) -> llm_pb2.Stats:
        """The scheduler's counters and queue lengths now (GetStats)."""
        return await self._call(self.llm.GetStats, llm_pb2.GetStatsRequest())

    async def tokenize(self, request: llm_pb2.TokenizeRequest) -> list[int]:
        """A text's tokens, or a conversation's through the chat template."""
        return list((await self._call(self.llm.Tokenize, request)).token_ids)

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self._call(self.llm.Detokenize, llm_pb2.DetokenizeRequest(token_ids=token_ids))).text

    def generate(self, request: llm_pb2.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        return self.llm.Generate(request)

    def chat(self, request: llm_pb2.ChatRequest) -> grpc.aio.UnaryStreamCall:
        return self.llm.Chat(request)

    async def health(self) -> str:
        """"" when the scheduler says SERVING, otherwise why not."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as err:
            return f"the scheduler at {self.address} does not answer: {err.code().name}: {err.details()}"
        if reply.status != _SERVING:
            return (f"the scheduler at {self.address} reports "
                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
        return ""

    async def wait_serving(self, poll_seconds: float = 0.5, remind_seconds: float = 60.0) -> None:
        """Returns once the scheduler says SERVING, logging that the gateway waits for it (and why, again
        every `remind_seconds`), then what it serves. Meanwhile /health answers 503 with the same reason."""
        problem = await self.health()
        started = reminded = time.monotonic()
        if problem:
            log.info("waiting for the scheduler: %s", problem)
        while problem:
            await asyncio.sleep(poll_seconds)
            problem = await self.health()
            if problem and time.monotonic() - reminded >= remind_seconds:
                log.info("still waiting for the scheduler after %.0fs: %s", time.monotonic() - started, problem)
                reminded = time.monotonic()
        try:
            info = await self.model_info()
        except OpenAIError as err:  # gone again at once; requests say so with a 503 of their own
            log.warning("the scheduler at %s went away right after it said SERVING: %s", self.address, err)
            return
        log.info("the scheduler at %s serves %s (max model len %d): the OpenAI API is ready", self.address,
                 info.model, info.max_model_len)

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None


def model_names(info: llm_pb2.ModelInfo, served_name: str) -> tuple[str, set[str]]:
    """The id /v1/models lists and every name a request may use for it: that id, the model
    path the workers loaded and its last component."""
    basename = os.path.basename(info.model.rstrip("/")) or info.model
    served = served_name or basename
    return served, {served, basename, info.model}


def check_model(requested: str | None, info: llm_pb2.ModelInfo, served_name: str) -> None:
    """404 for a model this server does not serve; an absent model means the served one."""
    served, names = model_names(info, served_name)
    if requested is not None and requested not in names:
        raise OpenAIError(404, f"the model `{requested}` does not exist; this server serves `{served}`",
                          "model", "model_not_found")
