"""The checks in front of every Worker RPC: the shared secret (--worker-token), then the scheduler
session (sessions.py) for the calls that change the worker. grpc.health.v1 stays open, so probes
need no secret."""
import hmac
from typing import Callable

import grpc

from nanoserve.wire import SESSION_KEY, TOKEN_KEY, TOKEN_SCHEME
from worker_svc.sessions import SessionRefused, Sessions

_SERVICE = "/nanoserve.v1.Worker/"


class WorkerGuard(grpc.ServerInterceptor):
    def __init__(self, token: str, sessions: Sessions):
        self.token = token
        self.sessions = sessions

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or not details.method.startswith(_SERVICE):
            return handler
        metadata = dict(details.invocation_metadata or ())
        method = details.method.removeprefix(_SERVICE)
        if self.token and not hmac.compare_digest(metadata.get(TOKEN_KEY, ""), TOKEN_SCHEME + self.token):
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "this worker requires the shared secret of --worker-token / NANOSERVE_WORKER_TOKEN "
                            "(the scheduler sends it when given the same flag); the call had none or another")
        session = metadata.get(SESSION_KEY, "")
        if method in ("AllocateKVCache", "Step") and not session:
            return _refusal(handler, grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method} needs a scheduler session id (metadata {SESSION_KEY}): is the scheduler "
                            "of the same nanoserve version as this worker?")
        if method == "AllocateKVCache":
            return _wrap_unary(handler, lambda context: self._allocate(session, context))
        if method == "Step":
            return _wrap_stream(handler, lambda context: self._open_stream(session, context))
        return handler

    def _allocate(self, session: str, context) -> Callable[[bool], None]:
        self.sessions.begin_allocation(session, context.peer())
        return lambda ok: self.sessions.end_allocation(session, ok)

    def _open_stream(self, session: str, context) -> None:
        self.sessions.open_stream(session)
        context.add_callback(lambda: self.sessions.close_stream(session))  # runs when the RPC ends, however


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, handler.request_deserializer,
                                                     handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


def _wrap_unary(handler: grpc.RpcMethodHandler, begin) -> grpc.RpcMethodHandler:
    """handler, with begin(context) first (SessionRefused -> FAILED_PRECONDITION); begin returns
    what to call with the outcome."""
    def behavior(request, context):
        try:
            finish = begin(context)
        except SessionRefused as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        ok = False
        try:
            reply = handler.unary_unary(request, context)
            ok = True
            return reply
        finally:
            finish(ok)

    return grpc.unary_unary_rpc_method_handler(behavior, handler.request_deserializer, handler.response_serializer)


def _wrap_stream(handler: grpc.RpcMethodHandler, begin) -> grpc.RpcMethodHandler:
    """handler, with begin(context) first (SessionRefused -> FAILED_PRECONDITION)."""
    def behavior(requests, context):
        try:
            begin(context)
        except SessionRefused as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        yield from handler.stream_stream(requests, context)

    return grpc.stream_stream_rpc_method_handler(behavior, handler.request_deserializer,
                                                 handler.response_serializer)
