"""The gateway's one connection to the scheduler: a single grpc.aio channel for every request."""
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.errors import OpenAIError, from_grpc
from nanoserve.v1 import llm_pb2, llm_pb2_grpc
from nanoserve.wire import GRPC_OPTIONS

_SERVING = health_pb2.HealthCheckResponse.SERVING


class SchedulerClient:
    """Opened inside the server's event loop (a grpc.aio channel is bound to the loop that made it)."""

    def __init__(self, address: str, rpc_timeout: float = 10.0):
        self.address = address
        self.rpc_timeout = rpc_timeout  # for the short calls; Generate runs as long as it generates
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
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
