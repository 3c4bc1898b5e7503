"""A Generate or Chat call that the gateway's fallback schedulers carry on (--scheduler a,b,...).

Read like the grpc.aio call it starts as (read(), cancel()), so the endpoints stream it as any
call: when it ends UNAVAILABLE (its scheduler went away, or has no worker left) the request is sent
to the next scheduler with what each completion received so far (GenerateRequest.resume), and the
client's response, an SSE stream included, goes on from there as if nothing happened.
"""
import logging

import grpc

from gateway_svc.scheduler_client import SchedulerClient
from nanoserve.failover import Progress, Request
from nanoserve.v1 import llm_pb2

log = logging.getLogger("nanoserve.gateway")


class FailoverCall:
    """`method` ("generate" or "chat") of `request` on the first of `schedulers`, the gateway's own;
    resumed on the next when it fails UNAVAILABLE, before its first message too, until every
    scheduler has failed in a row. Failover only: each new request starts on the gateway's own
    scheduler (spreading load is a router's job)."""

    def __init__(self, schedulers: list[SchedulerClient], method: str, request: Request):
        self.schedulers, self.method = schedulers, method
        self.progress = Progress(request)
        self.current = 0
        self.call = getattr(schedulers[0], method)(request)

    async def read(self) -> llm_pb2.GenerateResponse | object:
        """The next message, or grpc.aio.EOF; raises the AioRpcError of a failure no scheduler can take over."""
        failed = 0  # schedulers that failed in a row since the last message
        while True:
            try:
                message = await self.call.read()
            except grpc.aio.AioRpcError as err:
                if self.progress.done:  # every completion had ended: only the stream's close was lost
                    return grpc.aio.EOF
                failed += 1
                if err.code() != grpc.StatusCode.UNAVAILABLE or failed >= len(self.schedulers):
                    raise
                self._resume_elsewhere(err)
                continue
            if message is not grpc.aio.EOF:
                self.progress.record(message)
            return message

    def cancel(self) -> bool:
        return self.call.cancel()

    def _resume_elsewhere(self, error: grpc.aio.AioRpcError) -> None:
        broken = self.schedulers[self.current].address
        self.current = (self.current + 1) % len(self.schedulers)
        self.progress.failover(broken, self.schedulers[self.current].address, error, log)
        self.call = getattr(self.schedulers[self.current], self.method)(self.progress.resumed_request())
