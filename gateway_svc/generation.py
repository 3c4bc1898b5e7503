"""One Generate call answered as an OpenAI completion or chat completion, whole or streamed.

The call's first message is awaited before the HTTP response starts, so a request the
scheduler rejects (bad input, queue full, no worker) gets its own HTTP status even when
streamed. Each later gRPC message becomes one server-sent event as soon as it arrives.
Leaving early (a client that went away, an error) cancels the call, which frees its KV blocks.
"""
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway_svc.errors import OpenAIError, from_grpc
from gateway_svc.protocol import FINISH_REASONS, usage_json
from nanoserve.v1 import llm_pb2

_DONE = b"data: [DONE]\n\n"


@dataclass
class Shape:
    """What differs between /v1/completions and /v1/chat/completions."""
    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, text: str, finish_reason: str, usage: llm_pb2.Usage) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage_json(usage))

    def chunk(self, text: str, finish_reason: str | None = None) -> bytes:
        """One streamed event with the text produced since the previous one."""
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return event(self._envelope(self._chunk_object, [choice]))

    def role_chunk(self) -> bytes:
        """A chat stream's first event: who speaks."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return event(self._envelope(self._chunk_object, [choice]))

    def usage_chunk(self, usage: llm_pb2.Usage) -> bytes:
        return event(self._envelope(self._chunk_object, [], usage=usage_json(usage)))

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def open_call(call: grpc.aio.UnaryStreamCall) -> llm_pb2.GenerateResponse:
    """The call's first message; the scheduler's refusal as an OpenAIError. Cancels on failure."""
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    except BaseException:  # cancelled: the client went away while waiting
        call.cancel()
        raise
    if first is grpc.aio.EOF:
        raise OpenAIError(500, "the scheduler ended the stream without a result", code="internal")
    return first


async def gather(call: grpc.aio.UnaryStreamCall, shape: Shape) -> dict:
    """The whole completion as one response body."""
    parts = []
    msg = await open_call(call)
    try:
        while msg is not grpc.aio.EOF:
            parts.append(msg.text)
            last = msg
            msg = await call.read()
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    finally:
        call.cancel()  # a no-op once the call is complete
    return shape.whole("".join(parts), FINISH_REASONS[last.finish_reason], last.usage)


async def stream(call: grpc.aio.UnaryStreamCall, first: llm_pb2.GenerateResponse, shape: Shape,
                 include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events from the call's messages, ending with `data: [DONE]`."""
    try:
        if shape.chat:
            yield shape.role_chunk()
        msg = first
        while msg is not grpc.aio.EOF:
            if msg.finish_reason:
                yield shape.chunk(msg.text, FINISH_REASONS[msg.finish_reason])
                if include_usage:
                    yield shape.usage_chunk(msg.usage)
            elif msg.text:
                yield shape.chunk(msg.text)
            msg = await call.read()
        yield _DONE
    except grpc.aio.AioRpcError as err:  # too late for a status: the error travels as an event
        yield event(from_grpc(err).body())
        yield _DONE
    finally:
        call.cancel()  # the client went away mid-stream: the scheduler frees the request's blocks
