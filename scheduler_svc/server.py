"""The public nanoserve.v1.LLM service: admits requests, streams their tokens and text."""
import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nanoserve.v1 import llm_pb2, llm_pb2_grpc
from nanoserve.wire import GRPC_OPTIONS
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.requests import BadRequest, prompt_ids, sampling_options
from scheduler_svc.scheduler import AdmissionError
from scheduler_svc.sequence import Sequence
from scheduler_svc.tokenizer import TextTokenizer
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable

log = logging.getLogger("nanoserve.scheduler")
_FINISH = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}


class LLMService(llm_pb2_grpc.LLMServicer):
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.engine: Engine | None = None
        self.tokenizer: TextTokenizer | None = None
        self.info: llm_pb2.ModelInfo | None = None

    async def _ready_engine(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still connecting to its workers")
        if not self.engine.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker group can serve: {self.engine.failure}")
        return self.engine

    async def Generate(self, request: llm_pb2.GenerateRequest, context):
        engine = await self._ready_engine(context)
        try:
            ids = prompt_ids(request, self.tokenizer, self.info.vocab_size, self.info.max_model_len)
            options = sampling_options(request.sampling, self.info.vocab_size)
        except BadRequest as err:
            await context.abort(err.code, str(err))
        if engine.scheduler.num_waiting >= self.max_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_waiting} requests are already waiting; retry later")
        seq = Sequence(engine.new_seq_id(), ids, options)
        try:
            stream = engine.add(seq)
        except AdmissionError as err:
            code = grpc.StatusCode.INVALID_ARGUMENT if err.kind == "invalid" else grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(err))
        detokenizer = self.tokenizer.new_detokenizer()
        try:
            finished = False
            while not finished:
                await stream.wakeup.wait()
                if stream.error:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, stream.error)
                # Read before taking: the final token may land while the previous message is sent.
                finished = stream.finished
                tokens = stream.take()
                text = detokenizer.push(tokens)
                if finished:
                    text += detokenizer.flush()
                    usage = llm_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(seq.completion_token_ids),
                                          cached_prompt_tokens=seq.num_cached_prompt_tokens)
                    yield llm_pb2.GenerateResponse(request_id=request.request_id, token_ids=tokens, text=text,
                                                   finish_reason=_FINISH[seq.finish_reason], usage=usage)
                elif tokens:
                    yield llm_pb2.GenerateResponse(request_id=request.request_id, token_ids=tokens, text=text)
        finally:
            if not stream.finished:  # cancelled, disconnected or failed: free its blocks
                engine.abort(seq.seq_id)

    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context) -> llm_pb2.TokenizeResponse:
        await self._ready_engine(context)
        return llm_pb2.TokenizeResponse(token_ids=self.tokenizer.encode(request.text))

    async def GetModelInfo(self, request, context) -> llm_pb2.ModelInfo:
        await self._ready_engine(context)
        return self.info

    async def GetStats(self, request, context) -> llm_pb2.Stats:
        engine = await self._ready_engine(context)
        s, t = engine.scheduler, engine.totals
        return llm_pb2.Stats(num_waiting=s.num_waiting, num_running=s.num_running,
                             kv_blocks_total=s.num_total_blocks, kv_blocks_free=s.num_free_blocks,
                             prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                             prompt_tokens_total=t.prompt_tokens, generated_tokens_total=t.generated_tokens,
                             requests_finished=t.requests_finished, prefill_steps=t.prefill_steps,
                             decode_steps=t.decode_steps, prefill_tokens=t.prefill_tokens,
                             decode_tokens=t.decode_tokens, prefill_busy_seconds=t.prefill_busy_seconds,
                             decode_busy_seconds=t.decode_busy_seconds, decode_idle_seconds=t.decode_idle_seconds,
                             prefill_host_seconds=t.prefill_host_seconds, decode_host_seconds=t.decode_host_seconds)


def _scheduler_config(args: argparse.Namespace, group: WorkerGroup) -> SchedulerConfig:
    """The scheduler's limits: its own flags, narrowed to what every rank can take."""
    infos = group.infos

    def narrowest(flag: int, field: str) -> int:
        return min([flag] * bool(flag) + [getattr(info, field) for info in infos])

    return SchedulerConfig(num_kv_blocks=group.num_blocks, block_size=infos[0].block_size,
                           max_model_len=narrowest(args.max_model_len, "max_model_len"),
                           eos_token_ids=tuple(infos[0].eos_token_ids),
                           max_num_seqs=narrowest(args.max_num_seqs, "max_num_seqs"),
                           max_num_batched_tokens=narrowest(args.max_num_batched_tokens, "max_num_batched_tokens"),
                           enable_prefix_caching=args.enable_prefix_caching)


def _model_info(config: SchedulerConfig, group: WorkerGroup) -> llm_pb2.ModelInfo:
    info = group.infos[0]
    return llm_pb2.ModelInfo(model=info.model, vocab_size=info.vocab_size, max_model_len=config.max_model_len,
                             eos_token_ids=info.eos_token_ids, dtype=info.dtype, block_size=info.block_size,
                             num_kv_blocks=group.num_blocks, tensor_parallel_size=info.world_size,
                             attention_backend=info.attention_backend)


async def _serve(args: argparse.Namespace) -> int:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    service = LLMService(args.max_waiting)
    llm_pb2_grpc.add_LLMServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (llm_pb2.DESCRIPTOR.services_by_name["LLM"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        log.error("cannot listen on %s", address)
        return 1
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("listening on %s; connecting to workers %s", address, args.workers)

    group = WorkerGroup([a.strip() for a in args.workers.split(",") if a.strip()])
    try:
        await group.connect(args.worker_connect_timeout)
    except WorkerUnavailable as err:
        log.error("cannot start: %s", err)
        await server.stop(grace=0)
        return 1
    config = _scheduler_config(args, group)
    service.tokenizer = TextTokenizer(args.tokenizer or group.infos[0].model)
    service.info = _model_info(config, group)
    engine = Engine(group, config, args.worker_connect_timeout)

    def set_health(healthy: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(health_servicer.set("", status))

    engine.on_health_change = set_health
    engine.start()
    service.engine = engine
    set_health(True)
    log.info("serving %s (%d KV blocks, max model len %d)", service.info.model, config.num_kv_blocks,
             config.max_model_len)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await server.stop(grace=2)
    return 0


def serve_scheduler(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(_serve(args))
