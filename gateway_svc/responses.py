"""OpenAI's response bodies for a request's completions: a completion or chat completion whole,
or as the events of its stream. Choices carry their `index` (n > 1) and vLLM's `stop_reason`
(the stop string or stop token id that ended them; None for eos or a length limit)."""
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gateway_svc.logprobs import CompletionLogprobs, chat_content, prompt_logprobs
from gateway_svc.structured import tool_calls_json
from nanoserve.client import Completion
from nanoserve.v1 import llm_pb2

FINISH_REASONS = {"FINISH_REASON_STOP": "stop", "FINISH_REASON_LENGTH": "length", "FINISH_REASON_CANCELLED": "abort",
                  "FINISH_REASON_TOOL_CALLS": "tool_calls"}


@dataclass(frozen=True)
class Echo:
    """/v1/completions' echo: the prompt written before each choice's text."""
    text: str
    first_token: str | None = None  # with logprobs: the first prompt token's text (nothing scores it)


@dataclass(frozen=True)
class Output:
    """What a request asked to see beside the text."""
    n: int = 1
    logprobs: int | None = None         # alternatives per token (completions' logprobs, chat's top_logprobs)
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's tokens scored
    echo: Echo | None = None
    token_ids: bool = False             # vLLM's return_token_ids: each choice's token ids beside its text

    @property
    def scores_echo(self) -> bool:
        return self.echo is not None and self.logprobs is not None


@dataclass
class Reply:
    """One request's reply: what differs between the endpoints and what the request asked for."""
    chat: bool
    model: str
    output: Output = field(default_factory=Output)
    param_names: dict[str, str] = field(default_factory=dict)  # for errors: see errors.from_grpc
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, completions: Sequence[Completion]) -> dict:
        """The response body for all of a request's completions, in index order."""
        prompt_rows = completions[0].prompt_logprobs
        choices = [self._whole_choice(c, prompt_rows) for c in completions]
        body = self.envelope("chat.completion" if self.chat else "text_completion", choices,
                             usage=usage_json([c.usage for c in completions]))
        if self.output.prompt_logprobs is not None:
            scored = prompt_logprobs(prompt_rows, self.output.prompt_logprobs)
            for holder in [body] if self.chat else choices:  # where vLLM puts them
                holder["prompt_logprobs"] = scored
        return body

    def _whole_choice(self, c: Completion, prompt_rows: Sequence[llm_pb2.TokenLogprob]) -> dict:
        ending = {"finish_reason": FINISH_REASONS.get(c.finish_reason), "stop_reason": c.stop_reason}
        num_top = self.output.logprobs
        ids = {"token_ids": list(c.token_ids)} if self.output.token_ids else {}
        if self.chat:
            logprobs = None if num_top is None else {"content": chat_content(c.logprobs, num_top)}
            message = {"role": "assistant", "content": c.text}
            if c.tool_calls:  # OpenAI's content is null beside calls when there is no text
                message.update(content=c.text or None, tool_calls=tool_calls_json(c.tool_calls))
            return {"index": c.index, "message": message, "logprobs": logprobs, **ending, **ids}
        echo, text, rows = self.output.echo, c.text, c.logprobs
        if echo is not None:
            text = echo.text + text
            rows = [*prompt_rows, *rows]
        logprobs = None if num_top is None else \
            CompletionLogprobs(num_top).block(rows, echo.first_token if echo else None)
        return {"index": c.index, "text": text, "logprobs": logprobs, **ending, **ids}


class Chunks:
    """A streamed reply's events. Each choice's logprob offsets carry on from chunk to chunk; the
    usage adds up the choices' as they finish."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.num_top = reply.output.logprobs
        self.offsets: dict[int, CompletionLogprobs] = {}
        self.usages: dict[int, llm_pb2.Usage] = {}
        # Events differ only in their one choice: the envelope up to `"choices":[` is serialized once
        # (about a third of an event's JSON work; the gateway's loop does this for every token).
        self._head = b"data: " + _dumps(reply.envelope(self.reply.chunk_object, [])).removesuffix(b"]}")

    def opening(self, prompt_rows: Sequence[llm_pb2.TokenLogprob]) -> Iterator[bytes]:
        """Before any text, for each choice: chat says who speaks; completions echo the prompt."""
        echo = self.reply.output.echo
        for index in range(self.reply.output.n):
            if self.reply.chat:
                yield self._event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None, "stop_reason": None})
            elif echo is not None:
                logprobs = None if self.num_top is None else self._offsets(index).block(prompt_rows, echo.first_token)
                yield self._event({"index": index, "text": echo.text, "logprobs": logprobs, "finish_reason": None,
                                   "stop_reason": None})

    def message(self, msg: llm_pb2.GenerateResponse) -> bytes | None:
        """The event for one message of the call; None when it has nothing to show (its text held
        back, as a stop string or an unfinished character may still complete, and no logprobs or
        token ids asked for)."""
        scored, ids = self.num_top is not None, self.reply.output.token_ids
        calls = b"".join(self._tool_call(msg.index, call) for call in msg.tool_calls)
        if not (msg.text or msg.finish_reason or (scored and msg.logprobs) or (ids and msg.token_ids)):
            return calls or None
        ending = {"finish_reason": None, "stop_reason": None}
        if msg.finish_reason:
            self.usages[msg.index] = msg.usage
            kind = msg.WhichOneof("stop_reason")
            ending = {"finish_reason": FINISH_REASONS[llm_pb2.FinishReason.Name(msg.finish_reason)],
                      "stop_reason": None if kind is None else getattr(msg, kind)}
        if self.reply.chat:
            choice = {"index": msg.index, "delta": {"content": msg.text} if msg.text else {},
                      "logprobs": {"content": chat_content(msg.logprobs, self.num_top)} if scored else None}
        else:
            choice = {"index": msg.index, "text": msg.text,
                      "logprobs": self._offsets(msg.index).block(msg.logprobs) if scored else None}
        if ids:
            choice["token_ids"] = list(msg.token_ids)
        return calls + self._event({**choice, **ending})

    def _tool_call(self, index: int, part: llm_pb2.ToolCall) -> bytes:
        """A part of a call as OpenAI streams it: the call's index, id and name first, then its
        arguments' text as it comes."""
        deltas = [{"index": part.index, "function": {"arguments": part.arguments}}] if part.arguments else []
        if part.id:
            deltas.insert(0, {"index": part.index, "id": part.id, "type": "function",
                              "function": {"name": part.name, "arguments": ""}})
        return b"".join(self._event({"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}) for delta in deltas)

    def usage(self) -> bytes:
        """The last event before [DONE] (stream_options.include_usage): every choice's usage."""
        return event(self.reply.envelope(self.reply.chunk_object, [],
                                         usage=usage_json([self.usages[i] for i in sorted(self.usages)])))

    def _offsets(self, index: int) -> CompletionLogprobs:
        return self.offsets.setdefault(index, CompletionLogprobs(self.num_top))

    def _event(self, choice: dict) -> bytes:
        return self._head + _dumps(choice) + b"]}\n\n"


DONE = b"data: [DONE]\n\n"  # a stream's last event


def event(payload: dict) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


def _dumps(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def usage_json(usages: Sequence[llm_pb2.Usage]) -> dict:
    """A request's usage from its completions', in index order: the prompt counts once (they share
    it; completion 0 computed it, so its cache hits are the request's), their tokens add up."""
    first = usages[0]
    completion_tokens = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": first.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens}}
