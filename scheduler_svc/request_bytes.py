"""The first look at a request's bytes, before any handler runs: a request larger than
--max-request-bytes, or bytes that are not the method's message, are refused INVALID_ARGUMENT
with a message saying so (gRPC itself would answer UNKNOWN for bytes it cannot parse). The size is
checked before parsing, so an oversized prompt costs neither a parse nor a tokenization."""
import inspect
from typing import Callable

import grpc


class _Refused:
    """Stands in for a request that the handler must refuse: the deserializer cannot abort."""

    def __init__(self, message: str):
        self.message = message


class RequestBytesGuard(grpc.aio.ServerInterceptor):
    def __init__(self, max_request_bytes: int):
        self.max_request_bytes = max_request_bytes

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = self._deserializer(handler.request_deserializer, details.method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_refusing(handler.unary_unary), deserialize,
                                                       handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(_refusing(handler.unary_stream), deserialize,
                                                    handler.response_serializer)

    def _deserializer(self, parse: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
        def deserialize(data: bytes) -> object:
            if len(data) > self.max_request_bytes:
                return _Refused(f"the request is {len(data)} bytes; this server takes at most "
                                f"{self.max_request_bytes} (--max-request-bytes)")
            try:
                return parse(data)
            except Exception as err:  # protobuf's DecodeError, or whatever a parser raises on bad bytes
                return _Refused(f"the request bytes are not a valid message for {method}: {err}")
        return deserialize


def _refusing(behavior):
    """`behavior`, answering INVALID_ARGUMENT for a refused request instead of running."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, _Refused):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for message in behavior(request, context):
                yield message
        return stream

    async def unary(request, context):
        if isinstance(request, _Refused):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result
    return unary
