"""The official `openai` client's answers gathered choice by choice, from a whole response or from
its stream's chunks, so that the tests compare both paths with the same gRPC oracle."""
from dataclasses import dataclass, field
from typing import Any

import openai

# Parameters the client has arguments for; the others (vLLM's) travel in extra_body.
_TYPED = {"completions": {"top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "n",
                          "logprobs", "echo", "best_of", "max_tokens", "temperature", "suffix"},
          "chat": {"top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "n", "logprobs",
                   "top_logprobs", "max_tokens", "max_completion_tokens", "temperature", "tools", "response_format"}}


@dataclass
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: the `content` list.
    logprobs: Any = None
    role: str | None = None


@dataclass
class Answer:
    choices: list[Choice]
    usage: Any
    chunks: list = field(default_factory=list)  # a stream's, in order

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.choices]


def ask(oai: openai.OpenAI, endpoint: str, stream: bool, **params) -> Answer:
    """One request to /v1/completions (`prompt=`) or /v1/chat/completions (`messages=`); streams ask for usage."""
    typed = {k: v for k, v in params.items() if k in _TYPED[endpoint] or k in ("model", "prompt", "messages")}
    extra = {k: v for k, v in params.items() if k not in typed}
    create = oai.chat.completions.create if endpoint == "chat" else oai.completions.create
    if not stream:
        return _whole(create(**typed, extra_body=extra), endpoint == "chat")
    chunks = list(create(**typed, extra_body=extra, stream=True, stream_options={"include_usage": True}))
    return _streamed(chunks, endpoint == "chat")


def _whole(response, chat: bool) -> Answer:
    choices = []
    for c in response.choices:
        logprobs = None if c.logprobs is None else c.logprobs.model_dump()
        if chat:
            choices.append(Choice(c.index, c.message.content, c.finish_reason, c.model_extra["stop_reason"],
                                  None if logprobs is None else logprobs["content"], c.message.role))
        else:
            choices.append(Choice(c.index, c.text, c.finish_reason, c.model_extra["stop_reason"], logprobs))
    return Answer(choices, response.usage)


def _streamed(chunks: list, chat: bool) -> Answer:
    by_index: dict[int, Choice] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = by_index.setdefault(c.index, Choice(c.index))
            assert choice.finish_reason is None, "an event after the choice's finish_reason"
            choice.text += (c.delta.content if chat else c.text) or ""
            choice.role = choice.role or (c.delta.role if chat else None)
            choice.finish_reason = c.finish_reason
            choice.stop_reason = c.model_extra["stop_reason"]
            if c.logprobs is not None:
                choice.logprobs = _merged(choice.logprobs, c.logprobs.model_dump(), chat)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return Answer([by_index[i] for i in sorted(by_index)], chunks[-1].usage, chunks)


def _merged(so_far: Any, block: dict, chat: bool) -> Any:
    if chat:
        return (so_far or []) + block["content"]
    return {key: (so_far or {}).get(key, []) + values for key, values in block.items()}
