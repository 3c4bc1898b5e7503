"""The public nanoserve.v1.LLM service: admits requests, streams their tokens and text."""
import argparse
import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from nanoserve.checkpoint import TOKENIZER_FILE, CheckpointError, check_files
from nanoserve.gc_freeze import freeze_start_up_objects
from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve.hub import ModelNotFound
from nanoserve.listen import ListenError, check_port_free, listen
from nanoserve.mathutil import cdiv
from nanoserve.tls import TLSConfigError, tls_files
from nanoserve.v1 import llm_pb2, llm_pb2_grpc, worker_pb2
from nanoserve.wire import SERVER_OPTIONS
from scheduler_svc.chat_template import ChatTemplate, ChatTemplateError
from scheduler_svc.chat_tools import ChatTools, ToolError, template_message
from scheduler_svc.completions import CompletionOutput, ResumeError, completion_sequences
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.kv_events_config import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from scheduler_svc.request_bytes import RequestBytesGuard
from scheduler_svc.request_stream import RequestTimer
from scheduler_svc.request_validation import (BadRequest, RequestLimits, check_room, checked_length,
                                              completions_to_generate, prompt_ids, sampling_options)
from scheduler_svc.scheduler import AdmissionError
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.shutdown import DrainGuard, ServingHealth, Shutdown, Stopped
from scheduler_svc.structured_outputs import ConstraintError, GrammarCompiler, constraint_key
from scheduler_svc.tool_calls import ToolCallParser
from scheduler_svc.tokenizer import TextTokenizer
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable

if TYPE_CHECKING:  # type hints only: pyzmq is needed only when KV events are on
    from scheduler_svc.kv_event_publisher import KVEventPublisher

log = logging.getLogger("nanoserve.scheduler")


class LLMService(llm_pb2_grpc.LLMServicer):
    """nanoserve.v1.LLM over one engine. Until the workers have shaken hands every call answers
    UNAVAILABLE; while a failed group is rebuilt, requests are taken and held (recovery.py), and
    once the engine gives up waiting for it, UNAVAILABLE again until a group is back."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.engine: Engine | None = None
        self.tokenizer: TextTokenizer | None = None
        self.chat_template: ChatTemplate | None = None
        self.info: llm_pb2.ModelInfo | None = None
        self.limits: RequestLimits | None = None
        self.sampling_defaults = worker_pb2.SamplingDefaults()  # the model's, from its workers
        self.grammars: GrammarCompiler | None = None
        # Text is tokenized here, off the event loop: a long prompt must not stall the engine's steps.
        self.tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    async def _off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, function, *args)

    async def _ready_engine(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still connecting to its workers")
        if not self.engine.requests.accepts_requests:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no worker group can serve: {self.engine.requests.failure}")
        return self.engine

    async def Generate(self, request: llm_pb2.GenerateRequest, context):
        """Streams the completions of one prompt. The request is checked (INVALID_ARGUMENT) and
        queued (RESOURCE_EXHAUSTED when the waiting queue is full or it could never fit); then each
        message carries the tokens and text one completion produced since its previous message,
        its last one the finish reason and usage. A client that goes away (or whose deadline
        passes) frees the sequences' blocks; a worker failure pauses the stream until a restarted
        group recomputes it, or ends it UNAVAILABLE when none comes back in time. A coroutine that
        writes its messages, not an async generator: gRPC would wrap a generator in a loop of its
        own, which costs every streamed message a few microseconds more."""
        timer = RequestTimer()
        engine = await self._ready_engine(context)
        try:
            if request.WhichOneof("prompt") == "text":
                ids = await self._off_loop(prompt_ids, request, self.tokenizer, self.limits)
            else:
                ids = prompt_ids(request, self.tokenizer, self.limits)
            options = await self._options(request.sampling, len(ids))
            completions = completions_to_generate(request.resume, options, len(ids), self.limits)
        except BadRequest as err:
            await context.abort(err.code, str(err))
        await self._stream(engine, ids, options, completions, request.request_id, timer, context)

    async def _options(self, sampling: llm_pb2.SamplingParams, num_prompt_tokens: int,
                       thinking: str = "") -> SamplingOptions:
        """The request's checked sampling options, its constraint compiled (off the event loop; `thinking`
        as ChatTemplate.thinking says), or BadRequest."""
        options = sampling_options(sampling, self.limits, self.sampling_defaults)
        check_room(num_prompt_tokens, options.max_tokens, self.limits.max_model_len)
        constraint = constraint_key(sampling.structured_outputs)
        if constraint is None:
            return options
        try:
            grammar = await self._off_loop(self.grammars.compile, *constraint, thinking)
        except ConstraintError as err:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        return replace(options, grammar=grammar)

    async def Chat(self, request: llm_pb2.ChatRequest, context):
        """Generate on the conversation as the model's chat template writes it out."""
        timer = RequestTimer()
        engine = await self._ready_engine(context)
        try:
            tools = ChatTools(request)
            text = await self._off_loop(self._conversation_text, request, tools)
            ids = checked_length(await self._off_loop(self.tokenizer.encode, text, False), self.limits)
            sampling = await self._off_loop(tools.sampling, request.sampling, self.grammars)
            options = await self._options(sampling, len(ids), self.chat_template.thinking(text))
            completions = completions_to_generate(request.resume, options, len(ids), self.limits)
        except ToolError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except BadRequest as err:
            await context.abort(err.code, str(err))
        await self._stream(engine, ids, options, completions, request.request_id, timer, context,
                           parse_tools=tools.active)

    async def _stream(self, engine: Engine, ids: list[int], options: SamplingOptions,
                      completions: list[llm_pb2.ResumedCompletion], request_id: str, timer: RequestTimer, context,
                      parse_tools: bool = False):
        if engine.scheduler.num_waiting + len(completions) > self.max_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_waiting} requests are already waiting; retry later")
        seqs = completion_sequences([engine.new_seq_id() for _ in completions], ids, options, completions)
        wakeup = asyncio.Event()  # one for all the completions
        try:
            streams = [engine.submit(seq, wakeup) for seq in seqs]  # the first fails alone, or none does
        except AdmissionError as err:
            code = grpc.StatusCode.INVALID_ARGUMENT if err.kind == "invalid" else grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(err))
        try:
            outputs = [CompletionOutput(stream, self.tokenizer, request_id, completion.text)
                       for stream, completion in zip(streams, completions)]
        except ResumeError as err:
            for stream in streams:
                engine.requests.abort(stream.seq.seq_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        parsers = {id(output): ToolCallParser(completion.text)
                   for output, completion in zip(outputs, completions)} if parse_tools else {}
        for stream in streams:
            stream.timer = timer
        live = outputs  # the completions not done yet
        try:
            while live:
                await wakeup.wait()
                wakeup.clear()  # then every stream is read before the next wait: no wakeup is lost
                for output in live:
                    if output.stream.error:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, output.stream.error)
                    message = output.next_message()
                    if output.stop_string is not None:
                        engine.stop(output.seq)
                    if message is not None:
                        if parsers:
                            parsers[id(output)].apply(message)
                        await context.write(message)
                live = [output for output in live if not output.done]
        finally:
            for output in outputs:
                if not output.done:  # cancelled, disconnected, past its deadline or failed: free its blocks
                    engine.requests.abort(output.seq.seq_id)
                engine.metrics.request_finished(request_id, output.seq, timer)

    def _conversation_ids(self, request: llm_pb2.TokenizeRequest) -> list[int]:
        """The prompt ids of a request's conversation, through the chat template."""
        return self.tokenizer.encode(self._conversation_text(request), add_bos=False)  # the template writes any BOS

    def _conversation_text(self, request: llm_pb2.ChatRequest | llm_pb2.TokenizeRequest,
                           tools: ChatTools | None = None) -> str:
        if not request.messages:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "messages is empty: send at least one message")
        messages = [template_message(message) for message in request.messages]
        add_generation_prompt = (request.add_generation_prompt if request.HasField("add_generation_prompt")
                                 else True)
        template_kwargs = MessageToDict(request.chat_template_kwargs)
        if tools is not None and tools.active:
            template_kwargs["tools"] = tools.template_tools()
        try:
            return self.chat_template.render(messages, add_generation_prompt, template_kwargs)
        except ChatTemplateError as err:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None

    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context) -> llm_pb2.TokenizeResponse:
        await self._ready_engine(context)
        if request.messages and request.text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send either `text` or `messages`, not both")
        try:
            ids = await self._off_loop(self._conversation_ids if request.messages else self._text_ids, request)
        except BadRequest as err:
            await context.abort(err.code, str(err))
        return llm_pb2.TokenizeResponse(token_ids=ids)

    def _text_ids(self, request: llm_pb2.TokenizeRequest) -> list[int]:
        return self.tokenizer.encode(request.text)

    async def Detokenize(self, request: llm_pb2.DetokenizeRequest, context) -> llm_pb2.DetokenizeResponse:
        await self._ready_engine(context)
        vocab_size = self.limits.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
        text = self.tokenizer.decode(list(request.token_ids), skip_special_tokens=request.skip_special_tokens)
        return llm_pb2.DetokenizeResponse(text=text)

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
                             prefill_host_seconds=t.prefill_host_seconds, decode_host_seconds=t.decode_host_seconds,
                             mixed_steps=t.mixed_steps, mixed_decode_tokens=t.mixed_decode_tokens)


class StartupError(Exception):
    """A configuration the scheduler cannot serve; the message names the flags that fix it."""


def _scheduler_config(args: argparse.Namespace, group: WorkerGroup) -> SchedulerConfig:
    """The scheduler's limits: its own flags, narrowed to what every rank can take."""
    infos = group.infos

    def narrowest(flag: int, field: str) -> int:
        return min([flag] * bool(flag) + [getattr(info, field) for info in infos])

    block_size = infos[0].block_size
    return SchedulerConfig(num_kv_blocks=group.num_blocks, block_size=block_size,
                           max_model_len=_fitting_max_model_len(narrowest(args.max_model_len, "max_model_len"),
                                                                bool(args.max_model_len), group.num_blocks,
                                                                block_size),
                           eos_token_ids=tuple(infos[0].eos_token_ids),
                           max_num_seqs=narrowest(args.max_num_seqs, "max_num_seqs"),
                           max_num_batched_tokens=narrowest(args.max_num_batched_tokens, "max_num_batched_tokens"),
                           enable_prefix_caching=args.enable_prefix_caching,
                           enable_chunked_prefill=args.enable_chunked_prefill,
                           long_prefill_token_threshold=args.long_prefill_token_threshold)


def _fitting_max_model_len(max_model_len: int, asked: bool, num_blocks: int, block_size: int) -> int:
    """max_model_len when one sequence that long fits the KV pool. Otherwise an explicit
    --max-model-len is refused (the operator asked for something the pool cannot give), and the
    model's own limit is capped to the pool with a warning, so a model whose limit is larger than
    a small machine's pool (Qwen3's 40,960 tokens on CPU) still serves out of the box."""
    pool_tokens = num_blocks * block_size
    if max_model_len <= pool_tokens:
        return max_model_len
    more_memory = "give the KV cache more memory (--gpu-memory-utilization on GPU, --cpu-kv-cache-gb on CPU, " \
                  "or --num-kv-blocks)"
    if asked:
        raise StartupError(f"--max-model-len {max_model_len} does not fit the KV pool: one sequence that long needs "
                           f"{cdiv(max_model_len, block_size)} blocks of {block_size} tokens and the workers hold "
                           f"{num_blocks} ({pool_tokens} tokens); lower --max-model-len to {pool_tokens} or less, "
                           f"or {more_memory}")
    log.warning("max model len capped to %d tokens, the most one sequence can hold in the KV pool (%d blocks of "
                "%d tokens), below the model's %d: pass --max-model-len %d or less to silence this, or %s",
                pool_tokens, num_blocks, block_size, max_model_len, pool_tokens, more_memory)
    return pool_tokens


def _model_info(config: SchedulerConfig, group: WorkerGroup, limits: RequestLimits) -> llm_pb2.ModelInfo:
    info = group.infos[0]
    return llm_pb2.ModelInfo(model=info.model, vocab_size=info.vocab_size, max_model_len=config.max_model_len,
                             eos_token_ids=info.eos_token_ids, dtype=info.dtype, block_size=info.block_size,
                             num_kv_blocks=group.num_blocks, tensor_parallel_size=info.world_size,
                             attention_backend=info.attention_backend, max_logprobs=limits.max_logprobs,
                             max_n=limits.max_n, kv_cache_dtype=info.kv_cache_dtype, weight_dtype=info.weight_dtype,
                             quantization=info.quantization, platform=info.platform)


async def _serve(args: argparse.Namespace) -> int:
    worker_tls = tls_files(args, "worker_tls")
    shutdown = Shutdown(args.shutdown_timeout)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestBytesGuard(args.max_request_bytes),
                                                                   DrainGuard(shutdown)])
    try:  # what can fail at once, before any waiting
        if args.metrics_port:
            check_port_free(args.host, args.metrics_port, "the scheduler's --metrics-port")
        if args.tokenizer:
            _check_tokenizer_files(args.tokenizer)
        kv_events_config = parse_kv_events_config(args.kv_events_config)
        worker_tls.channel_credentials()
        address = listen(server, args.host, args.port, "the scheduler's --port", tls_files(args).server_credentials())
    except (ListenError, CheckpointError, TLSConfigError, KVEventsConfigError) as err:
        log.error("cannot start: %s", err)
        return 1
    shutdown.listen()
    service = LLMService(args.max_waiting)
    llm_pb2_grpc.add_LLMServicer_to_server(service, server)
    llm_service = llm_pb2.DESCRIPTOR.services_by_name["LLM"].full_name
    serving_health = ServingHealth(server, llm_service, shutdown)
    reflection.enable_server_reflection((llm_service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    await serving_health.start()
    log.info("listening on %s; connecting to workers %s", address, args.workers)

    group = WorkerGroup([a.strip() for a in args.workers.split(",") if a.strip()], args.worker_token, worker_tls,
                        args.step_timeout)
    try:
        await shutdown.unless_asked(group.connect(args.worker_connect_timeout))
        config = _scheduler_config(args, group)
        # The model's own revision applies to its tokenizer, not to another --tokenizer.
        service.tokenizer = _tokenizer(args.tokenizer or group.infos[0].model,
                                       "" if args.tokenizer else args.revision, args.download_dir)
        kv_events = _kv_event_publisher(kv_events_config, config.block_size)
    except (WorkerUnavailable, StartupError, Stopped) as err:
        await group.close()
        await server.stop(grace=0)
        if isinstance(err, Stopped):
            log.info("stopped before serving")
            return 0
        log.error("cannot start: %s", err)
        return 1
    service.chat_template = ChatTemplate(service.tokenizer.directory)
    service.limits = RequestLimits(group.infos[0].vocab_size, config.max_model_len, args.max_n,
                                   min(args.max_logprobs, group.infos[0].vocab_size))
    service.info = _model_info(config, group, service.limits)
    service.sampling_defaults = group.infos[0].sampling_defaults
    service.grammars = GrammarCompiler(GrammarTokenizer(service.tokenizer.directory / TOKENIZER_FILE,
                                                        group.infos[0].vocab_size, config.eos_token_ids))
    engine = Engine(group, config, args.worker_restart_timeout, kv_events)
    engine.requests.on_health_change = lambda healthy: asyncio.get_running_loop().create_task(
        serving_health.set(healthy))
    engine.start()
    service.engine = engine
    if args.metrics_port:
        engine.metrics.serve(args.host, args.metrics_port)
    await serving_health.set(True)
    freeze_start_up_objects()
    log.info("serving %s (%d KV blocks, max model len %d)", service.info.model, config.num_kv_blocks,
             config.max_model_len)

    if not await shutdown.asked_before(engine.task):  # the engine ended: no worker group can ever serve again
        if kv_events is not None:
            kv_events.close()
        log.error("exiting: %s", engine.requests.failure)
        await server.stop(grace=1)
        return 1
    await shutdown.drain(serving_health, engine.requests.give_up)
    await server.stop(grace=2)  # the calls ended above write their status
    await engine.close()
    if kv_events is not None:
        kv_events.close()
    log.info("stopped")
    return 0


def _kv_event_publisher(config: KVEventsConfig, block_size: int) -> "KVEventPublisher | None":
    """The publisher --kv-events-config asks for (None: events off), or StartupError."""
    if not config.enabled:
        return None
    try:  # pyzmq and msgpack: needed only when events are on
        from scheduler_svc.kv_event_publisher import KVEventPublisher
    except ImportError as err:
        raise StartupError(f"--kv-events-config turns KV events on, which need pyzmq and msgpack ({err}); "
                           "install them: pip install 'nanoserve[kv-events]'") from None
    try:
        return KVEventPublisher(config, block_size)
    except OSError as err:
        raise StartupError(str(err)) from None


def _check_tokenizer_files(directory: str) -> None:
    """CheckpointError naming tokenizer.json when a local directory lacks it (anything that is not
    a local directory, e.g. a Hub id, is left to the tokenizer)."""
    if Path(directory).is_dir():
        check_files(directory, (TOKENIZER_FILE,), "--tokenizer / the workers' --model")


def _tokenizer(directory: str, revision: str, download_dir: str) -> TextTokenizer:
    """The tokenizer of `directory` (--tokenizer, else the model the workers serve: a local
    directory or a Hub id), or StartupError."""
    try:
        _check_tokenizer_files(directory)
        return TextTokenizer(directory, revision, download_dir)
    except (CheckpointError, ModelNotFound) as err:
        raise StartupError(str(err)) from None
    except Exception as err:  # tokenizers raises plain Exceptions for unreadable files
        raise StartupError(f"cannot load the tokenizer of {directory}: {err}") from None


def serve_scheduler(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))
