"""One Generate (or Chat) call answered as an OpenAI completion or chat completion, whole or streamed.

The call's first message is awaited before the HTTP response starts, so a request the
scheduler rejects (bad input, queue full, no worker) gets its own HTTP status even when
streamed. Each later gRPC message becomes one server-sent event as soon as it arrives; with
n > 1 the choices' events interleave as the scheduler's messages do, each with its index.
Leaving early (a client that went away, an error) cancels the call, which frees its KV blocks.
"""
from collections.abc import AsyncIterator

import grpc

from gateway_svc.errors import OpenAIError, from_grpc
from gateway_svc.responses import DONE, Chunks, Reply, event
from nanoserve.client import Completion
from nanoserve.v1 import llm_pb2


async def open_call(call: grpc.aio.UnaryStreamCall, reply: Reply) -> list[llm_pb2.GenerateResponse]:
    """The call's first message; with a scored echo, the messages up to the one carrying the
    prompt's logprobs (they open every choice's stream). The scheduler's refusal as an
    OpenAIError. Cancels on failure."""
    head = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            head.append(msg)
            if not reply.output.scores_echo or msg.prompt_logprobs:
                break
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err, reply.param_names) from None
    except BaseException:  # cancelled: the client went away while waiting
        call.cancel()
        raise
    if not head:
        raise OpenAIError(500, "the scheduler ended the stream without a result", code="internal")
    return head


async def _messages(call: grpc.aio.UnaryStreamCall,
                    head: list[llm_pb2.GenerateResponse]) -> AsyncIterator[llm_pb2.GenerateResponse]:
    for msg in head:
        yield msg
    while (msg := await call.read()) is not grpc.aio.EOF:
        yield msg


async def gather(call: grpc.aio.UnaryStreamCall, reply: Reply) -> dict:
    """The whole reply as one response body."""
    completions: dict[int, Completion] = {}
    head = await open_call(call, reply)
    try:
        async for msg in _messages(call, head):
            completions.setdefault(msg.index, Completion(index=msg.index)).add(msg)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err, reply.param_names) from None
    finally:
        call.cancel()  # a no-op once the call is complete
    return reply.whole([completions[index] for index in sorted(completions)])


async def stream(call: grpc.aio.UnaryStreamCall, head: list[llm_pb2.GenerateResponse], reply: Reply,
                 include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events from the call's messages, ending with `data: [DONE]`."""
    chunks = Chunks(reply)
    try:
        for data in chunks.opening(next((m.prompt_logprobs for m in head if m.prompt_logprobs), [])):
            yield data
        async for msg in _messages(call, head):
            if data := chunks.message(msg):
                yield data
        if include_usage:
            yield chunks.usage()
        yield DONE
    except grpc.aio.AioRpcError as err:  # too late for a status: the error travels as an event
        yield event(from_grpc(err, reply.param_names).body())
        yield DONE
    finally:
        call.cancel()  # the client went away mid-stream: the scheduler frees the request's blocks
