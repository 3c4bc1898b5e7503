"""A stream cancelled while failover opens the next replica's call (nanoserve/failover.py): the new call is
cancelled too, so the stream ends on CANCELLED instead of running on. gRPC calls are stood in."""
import grpc
import pytest

from nanoserve.failover import ResumingStream
from nanoserve.v1 import llm_pb2


class Ended(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


class FakeCall:
    """A stream that ends with `ending` at once, or after its cancel()."""

    def __init__(self, ending: grpc.StatusCode | None = None):
        self.ending, self.cancelled = ending, False

    def __next__(self) -> llm_pb2.GenerateResponse:
        if self.cancelled:
            raise Ended(grpc.StatusCode.CANCELLED)
        if self.ending is not None:
            raise Ended(self.ending)
        return llm_pb2.GenerateResponse(text="x")

    def cancel(self) -> None:
        self.cancelled = True


def test_a_cancel_while_the_next_replica_is_opened_cancels_its_call():
    calls = []

    def broken(request, timeout):
        calls.append(FakeCall(grpc.StatusCode.UNAVAILABLE))
        return calls[-1]

    def opened_under_a_cancel(request, timeout):
        stream.cancel()  # Ctrl-C lands here: the old call is the one cancelled
        calls.append(FakeCall())
        return calls[-1]
    stream = ResumingStream([broken, opened_under_a_cancel], ["a", "b"], 0,
                            llm_pb2.GenerateRequest(text="hi"), None, lambda event: None)
    with pytest.raises(grpc.RpcError) as ended:
        next(stream)
    assert ended.value.code() == grpc.StatusCode.CANCELLED and calls[-1].cancelled
