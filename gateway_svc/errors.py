"""Errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, with the HTTP
status a client can act on; gRPC statuses from the scheduler map onto them."""
import re
from collections.abc import Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanoserve.v1 import llm_pb2

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 501: "not_implemented_error", 503: "service_unavailable_error",
          504: "timeout_error"}
_FROM_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
              grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
              grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
              grpc.StatusCode.DEADLINE_EXCEEDED: 504}
# The request fields an INVALID_ARGUMENT message may start with: the sampling's, and Chat's tools.
_SAMPLING_FIELDS = frozenset(llm_pb2.SamplingParams.DESCRIPTOR.fields_by_name) | {"tools", "tool_choice"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param, code)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param, "unsupported_parameter")


def from_grpc(err: grpc.aio.AioRpcError, param_names: Mapping[str, str] | None = None) -> OpenAIError:
    """The scheduler's status as an HTTP error; its message already says what to fix. Its
    INVALID_ARGUMENT messages start with the SamplingParams field they refuse: the error names
    the request's parameter for it (`param_names`: where the request calls it otherwise, as the
    message then does too)."""
    code, message = err.code(), err.details() or err.code().name
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = re.match(r"\w+", message)
        if field and field[0] in _SAMPLING_FIELDS:
            param = (param_names or {}).get(field[0], field[0])
            message = param + message[field.end():]
    return OpenAIError(_FROM_GRPC.get(code, 500), message, param, code.name.lower())


def install_handlers(app: FastAPI) -> None:
    """OpenAI's shape for our own errors, for unknown paths and methods, and for request bodies that
    are not JSON or fail validation (400, not 422)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(routing_error(request.method, request.url.path, err).body(), status_code=err.status_code,
                            headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(body_error(err.errors()[0]).body(), status_code=400)


def routing_error(method: str, path: str, err: HTTPException) -> OpenAIError:
    """Starlette's 404 and 405 (and any other HTTPException) said as OpenAI does: "Invalid URL"."""
    if err.status_code == 404:
        return OpenAIError(404, f"Invalid URL ({method} {path}): the OpenAI API is under /v1 "
                                "(/v1/completions, /v1/chat/completions, /v1/models)")
    if err.status_code == 405:
        return OpenAIError(405, f"Invalid method for URL ({method} {path}): use {(err.headers or {}).get('Allow')}")
    return OpenAIError(err.status_code, str(err.detail))


def body_error(first: dict) -> OpenAIError:
    """A body that is not JSON names no parameter (FastAPI's location is a character offset); a
    parameter that fails validation is `param`, its path in the message."""
    if first.get("type") == "json_invalid":
        offset = first.get("loc", ("body", "?"))[-1]
        return OpenAIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error')} "
                                f"(at character {offset})", code="invalid_json")
    fields = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(fields)
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return bad_request(message, fields[0] if fields else None)
