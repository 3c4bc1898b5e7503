"""A step whose work is queued on the device: the runner returns it before the work is done, so
the worker can queue the next step first, and turns it into its reply once it is.

Timings come from the device itself: on CUDA, events around the step's work, so `busy` is the
time the GPU spent on this step and `idle` the gap it sat empty since the step before (the work
a host falls behind on); on CPU, where work runs as it is issued, the host's clock. `host` is the
time the host spent turning the request into queued work.
"""
import time
from typing import Callable

import torch

from nanoserve.v1 import worker_pb2
from worker_svc.sampling_extras import StepLogprobs

# Steps launched and not yet replied to. Three keep the device fed through a late scheduler turn;
# reported at the handshake, so the scheduler sends no more than this ahead of the replies. The
# step buffers' host staging ring is sized from it.
MAX_STEPS_IN_FLIGHT = 3


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # Steps queue on the device's default stream, whichever thread launches them; looked up once,
        # since Event.record() without one looks up the current stream in Python on every mark.
        self.stream = torch.cuda.default_stream(device) if self.cuda else None
        self.last_end = None  # the previous step's end mark

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def seconds(self, start, end) -> float:
        if start is None:
            return 0.0
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class LaunchedStep:
    def __init__(self, clock: StepClock, start, tokens: torch.Tensor | None, host_started: float,
                 logprobs: StepLogprobs | None = None):
        """`host_started`: time.perf_counter() when the host began the step."""
        self.clock, self.start, self.previous_end = clock, start, clock.last_end
        self.tokens, self.logprobs = tokens, logprobs
        if tokens is not None and clock.cuda:  # start the copy home now; reply() waits for it
            self.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.tokens.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs.copy_home()
        self.end = clock.last_end = clock.mark()
        self.host_seconds = time.perf_counter() - host_started
        # Host work that needs the step's tokens but not its reply (the grammars' advance): after_reply()
        # runs it on the reply's thread, which is awake for them anyway, once the reply is on its way.
        self.on_home: Callable[[], None] | None = None

    def tokens_home(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The sampled tokens in host memory and, on CUDA, the event after which they are there."""
        return self.tokens, self.end if self.clock.cuda else None

    def reply(self, step_id: int) -> worker_pb2.StepResponse:
        """Waits for the step's work, then its sampled tokens (rank 0) and timings."""
        if self.clock.cuda:
            self.end.synchronize()
        reply = worker_pb2.StepResponse(
            step_id=step_id, token_ids=[] if self.tokens is None else self.tokens.tolist(),
            busy_seconds=self.clock.seconds(self.start, self.end),
            idle_seconds=self.clock.seconds(self.previous_end, self.start), host_seconds=self.host_seconds)
        if self.logprobs is not None:
            self.logprobs.fill(reply)
        return reply

    def after_reply(self) -> None:
        """The work that waited for the step's tokens and not for its reply, run once the reply is sent:
        the scheduler, which sends the next step on it, has the tokens first (run before the reply, the
        grammars' advance at batch 1 added its ~0.1 ms, GIL waits included, to every step's round trip)."""
        if self.on_home is not None:
            self.on_home()


class RefusedStep:
    """A step the runner refused before queuing any work (a bad request): its reply, at once,
    carries the reason. The step loop handles it like a LaunchedStep."""

    def __init__(self, reason: str):
        self.reason = reason

    def reply(self, step_id: int) -> worker_pb2.StepResponse:
        return worker_pb2.StepResponse(step_id=step_id, error=self.reason)

    def after_reply(self) -> None:
        """Nothing waits for a refused step's tokens."""
