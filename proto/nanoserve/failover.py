"""A Generate or Chat stream that outlives its replica (DESIGN §11, replica loss).

Replicas of one model share nothing, but a completion can move between them: the request is sent
again with what each unfinished completion received so far (GenerateRequest.resume), and the new
replica continues it as its own recovery would, so a seeded completion goes on with the tokens the
first would have drawn. The caller iterates one stream; only `on_failover` and a warning in the
log say that it moved.
"""
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from nanoserve.v1 import llm_pb2

log = logging.getLogger("nanoserve.client")

Request = llm_pb2.GenerateRequest | llm_pb2.ChatRequest


@dataclass(frozen=True)
class Failover:
    """A stream that broke at `from_address` (with `error`) and goes on at `to_address`, where
    `received` tokens (all completions') were in hand."""
    from_address: str
    to_address: str
    error: str
    received: int


class Progress:
    """What a request's stream carried so far, by unfinished completion: all a resume needs."""

    def __init__(self, request: Request):
        self.request = request
        n = request.sampling.n if request.sampling.HasField("n") else 1
        listed = request.resume or [llm_pb2.ResumedCompletion(index=index) for index in range(n)]
        self.unfinished = {c.index: llm_pb2.ResumedCompletion(index=c.index, token_ids=c.token_ids, text=c.text)
                           for c in listed}
        self.received = 0  # tokens, all completions'
        self.begun = False  # a message arrived

    @property
    def done(self) -> bool:
        """Every completion has ended: a stream that breaks now lost only its close."""
        return not self.unfinished

    def record(self, message: llm_pb2.GenerateResponse) -> None:
        completion = self.unfinished[message.index]
        completion.token_ids.extend(message.token_ids)
        completion.text += message.text
        self.received += len(message.token_ids)
        self.begun = True
        if message.finish_reason:
            del self.unfinished[message.index]

    def resumed_request(self) -> Request:
        """The request again, resuming each unfinished completion after what it carried."""
        request = type(self.request)()
        request.CopyFrom(self.request)
        del request.resume[:]
        request.resume.extend(self.unfinished[index] for index in sorted(self.unfinished))
        return request

    def failover(self, from_address: str, to_address: str, error: grpc.RpcError, log: logging.Logger) -> Failover:
        """The event of moving the stream, logged on `log`: a warning for a stream that broke, a line
        of its own for a request that the replica refused before it began."""
        event = Failover(from_address, to_address, f"{error.code().name}: {error.details()}", self.received)
        if self.begun:
            log.warning("the stream from %s broke (%s): resuming %d completion(s) after %d token(s) on %s",
                        from_address, event.error, len(self.unfinished), self.received, to_address)
        else:
            log.info("%s cannot take the request (%s): sending it to %s", from_address, event.error, to_address)
        return event


class ResumingStream(Iterator[llm_pb2.GenerateResponse]):
    """The messages of one request, from replica `start` of `addresses` (`methods`: their bound
    Generate or Chat). A stream that ends UNAVAILABLE (the replica died, or has no worker left) is
    resumed on the next replica; a replica that fails before sending anything passes it on too,
    until every replica has failed in a row. Other errors, and a stream the caller cancelled, end
    it as a plain gRPC stream would. `timeout` bounds the whole request, every replica included."""

    def __init__(self, methods: list[Callable], addresses: list[str], start: int, request: Request,
                 timeout: float | None, on_failover: Callable[[Failover], None]):
        self.methods, self.addresses, self.replica = methods, addresses, start
        self.progress = Progress(request)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.on_failover = on_failover
        self.cancelled = False
        self.call = self._open(request)

    def __next__(self) -> llm_pb2.GenerateResponse:
        failed = 0  # replicas that failed in a row since the last message
        while True:
            try:
                message = next(self.call)
            except grpc.RpcError as err:
                if self.progress.done:
                    raise StopIteration from None
                failed += 1
                if err.code() != grpc.StatusCode.UNAVAILABLE or self.cancelled or failed >= len(self.methods):
                    raise
                self._resume_elsewhere(err)
                continue
            self.progress.record(message)
            return message

    def cancel(self) -> None:
        self.cancelled = True
        self.call.cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """As grpc.RpcContext.add_callback, for the call in progress: `callback` when it ends."""
        return self.call.add_callback(callback)

    def _resume_elsewhere(self, error: grpc.RpcError) -> None:
        broken = self.addresses[self.replica]
        self.replica = (self.replica + 1) % len(self.methods)
        self.on_failover(self.progress.failover(broken, self.addresses[self.replica], error, log))
        self.call = self._open(self.progress.resumed_request())
        if self.cancelled:  # cancelled (Ctrl-C) while the next replica's call was being opened
            self.call.cancel()

    def _open(self, request: Request):
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return self.methods[self.replica](request, timeout=timeout)
