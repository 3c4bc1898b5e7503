"""The HTTP endpoints: OpenAI's completions, chat completions and models, plus vLLM's health,
tokenize, detokenize and render, Prometheus' /metrics (the gateway's own and the model-server
protocol's), and the load endpoints routers poll."""
import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from gateway_svc import generation
from gateway_svc.drain import Drain
from gateway_svc.engine_metrics import engine_exposition
from gateway_svc.errors import OpenAIError, bad_request, install_handlers
from gateway_svc.failover_call import FailoverCall
from gateway_svc.http_metrics import HTTPMetrics, exposition
from gateway_svc.load_api import add_load_routes
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway_svc.render import add_render_routes, check_vocabulary
from gateway_svc.responses import Echo, Reply
from gateway_svc.scheduler_client import SchedulerClient, check_model, model_names
from nanoserve.flags import GATEWAY_TITLE
from nanoserve.race import Interrupted, unless
from nanoserve.v1 import llm_pb2

T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class GatewayConfig:
    # host:port of the scheduler's public gRPC API; after it, comma-separated, fallbacks that take
    # over the streams it breaks (failover_call.py)
    scheduler: str
    shutdown_timeout: float      # seconds a stopping process lets its requests finish (drain.py)
    served_model_name: str = ""  # the id /v1/models lists; default: the model directory's name
    vllm_metric_names: bool = False  # /metrics also carries the model-server gauges under vLLM's names


class Gateway:
    """What the endpoints share: the scheduler connection (opened in the server's event loop)."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client: SchedulerClient | None = None  # the gateway's own scheduler
        self.fallbacks: list[SchedulerClient] = []

    def call(self, method: str, request: llm_pb2.GenerateRequest | llm_pb2.ChatRequest) -> grpc.aio.UnaryStreamCall:
        """`method` ("generate" or "chat") on the gateway's own scheduler; with fallbacks, a call they
        take over when it breaks."""
        if not self.fallbacks:
            return getattr(self.client, method)(request)
        return FailoverCall([self.client, *self.fallbacks], method, request)

    async def checked_model(self, requested: str | None) -> str:
        """The served model's id, after a 404 for any other model."""
        info = await self.client.model_info()
        check_model(requested, info, self.config.served_model_name)
        return model_names(info, self.config.served_model_name)[0]

    async def prompt_echo(self, request: llm_pb2.GenerateRequest, scored: bool) -> Echo:
        """What completions' echo writes before each choice: the prompt's text and, when scored,
        its first token's (the scheduler's prompt_logprobs score the tokens after it)."""
        if request.WhichOneof("prompt") == "text":
            text = request.text
            ids = await self.client.tokenize(llm_pb2.TokenizeRequest(text=text)) if scored else []
        else:
            ids = list(request.token_ids.ids)
            text = await self.client.detokenize(ids)
        return Echo(text, await self.client.detokenize(ids[:1]) if scored else None)


def create_app(config: GatewayConfig) -> HTTPMetrics:
    """The ASGI application uvicorn serves: the FastAPI app inside its HTTP metrics."""
    gateway = Gateway(config)
    registry = CollectorRegistry()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        drain.listen()
        gateway.client, *gateway.fallbacks = [SchedulerClient(address.strip())
                                              for address in config.scheduler.split(",")]
        waiting = asyncio.create_task(gateway.client.wait_serving())  # the port opens at once: /health says why not
        yield
        waiting.cancel()
        for client in [gateway.client, *gateway.fallbacks]:
            await client.close()

    app = FastAPI(title=GATEWAY_TITLE, lifespan=lifespan)
    install_handlers(app)
    add_load_routes(app, lambda: gateway.client, config.served_model_name)
    add_render_routes(app, lambda: gateway.client, config.served_model_name)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, err: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the status is for the metrics

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        model = await gateway.checked_model(body.model)
        call_request = body.generate_request()
        echo = await gateway.prompt_echo(call_request, body.scores_prompt) if body.echo else None
        reply = Reply(chat=False, model=model, output=body.output(echo), param_names=body.param_names())
        call_request.request_id = reply.id
        return await _respond(request, gateway.call("generate", call_request), reply, body.stream,
                              body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check_supported()
        reply = Reply(chat=True, model=await gateway.checked_model(body.model), output=body.output(),
                      param_names=body.param_names())
        call_request = body.chat_request()
        call_request.request_id = reply.id
        return await _respond(request, gateway.call("chat", call_request), reply, body.stream, body.include_usage)

    @app.get("/v1/models")
    async def models():
        info = await gateway.client.model_info()
        served = model_names(info, config.served_model_name)[0]
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "nanoserve", "root": info.model, "parent": None,
                                            "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health():
        problem = await gateway.client.health()
        if problem:
            raise OpenAIError(503, problem, code="unavailable")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        await gateway.checked_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either `prompt` or `messages`", "prompt")
        if body.messages is None:
            tokens = await gateway.client.tokenize(llm_pb2.TokenizeRequest(text=body.prompt))
        else:
            tokens = await gateway.client.tokenize(body.tokenize_request())
        info = await gateway.client.model_info()
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        await gateway.checked_model(body.model)
        check_vocabulary(body.tokens, (await gateway.client.model_info()).vocab_size, "tokens")
        return {"prompt": await gateway.client.detokenize(body.tokens)}

    @app.get("/metrics")
    async def metrics():
        engine = await engine_exposition(gateway.client, config.served_model_name, config.vllm_metric_names)
        return Response(exposition(registry) + engine, media_type=CONTENT_TYPE_LATEST)

    paths = {route.path for route in app.routes}
    drain = Drain(app, config.shutdown_timeout)  # the lifespan above starts its signal handling
    return HTTPMetrics(drain, registry, paths)


async def _respond(request: Request, call: grpc.aio.UnaryStreamCall, reply: Reply, stream: bool,
                   include_usage: bool):
    if not stream:
        return JSONResponse(await _unless_disconnected(request, generation.gather(call, reply)))
    head = await _unless_disconnected(request, generation.open_call(call, reply))
    return StreamingResponse(generation.stream(call, head, reply, include_usage), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and the gRPC call inside) if the client disconnects first."""
    try:
        return await unless(work, _disconnect(request))
    except Interrupted:
        raise _ClientGone() from None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
