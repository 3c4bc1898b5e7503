"""What the engine hands one sequence's handler: its new tokens and logprob rows, when it ended,
and the times its request arrived, was first scheduled and got its first token."""
import asyncio
import time
from dataclasses import dataclass, field

from scheduler_svc.logprob_rows import ScoredToken
from scheduler_svc.sequence import Sequence


@dataclass
class RequestTimer:
    """When one request arrived, was first scheduled and got its first token (monotonic seconds)."""
    arrived: float = field(default_factory=time.monotonic)
    scheduled: float | None = None    # stamped by the engine when a step first computes it
    first_token: float | None = None

    def received(self, token_ids: list[int]) -> None:
        if token_ids and self.first_token is None:
            self.first_token = time.monotonic()


@dataclass(eq=False)  # compared and hashed by identity: the waker keeps a set of them
class RequestStream:
    """What the engine has produced for one sequence and not yet handed to its handler. The
    completions of one request (n > 1) share their wakeup."""
    seq: Sequence
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[ScoredToken] = field(default_factory=list)  # one per new token, when asked for
    prompt_logprobs: list[ScoredToken] = field(default_factory=list)  # every prompt row so far, in order
    finished: bool = False
    error: str = ""  # set when no worker group can serve it; the handler answers UNAVAILABLE
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    timer: RequestTimer = field(default_factory=RequestTimer)

    def take(self) -> list[int]:
        """The tokens since the last take. The wakeup stays as it is: the handler clears it before
        reading all of its streams, and clearing it here, between the writes of an n > 1 request,
        lost the wakeup of a completion already read (a stream that never ended)."""
        tokens, self.new_tokens = self.new_tokens, []
        return tokens

    def take_logprobs(self) -> list[ScoredToken]:
        """The logprob rows since the last take (of a sequence that asks for logprobs)."""
        logprobs, self.new_logprobs = self.new_logprobs, []
        return logprobs
