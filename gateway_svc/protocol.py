"""OpenAI request bodies (with vLLM's extra sampling fields), checked and turned into gRPC.

Parameters the scheduler's API cannot carry yet are accepted at their neutral value and
answered 400 otherwise, naming the parameter, so a client never gets silently different output.
"""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway_svc.errors import bad_request, not_supported_yet
from nanoserve.v1 import llm_pb2

_UINT64_MAX = 2**64 - 1
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
# Parameter -> the values that leave generation unchanged (the scheduler API has no field yet).
_NOT_YET: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "min_tokens": (None, 0), "logit_bias": (None, {}), "stop": (None, "", []), "logprobs": (None, False),
    "top_logprobs": (None, 0), "prompt_logprobs": (None,), "echo": (None, False), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share. Unknown fields are ignored, as vLLM ignores them."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=_UINT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    user: str | None = None
    # Not carried by the scheduler's API yet (see _NOT_YET).
    n: int | None = Field(None, ge=1)
    best_of: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        for name, neutral in _NOT_YET.items():
            value = getattr(self, name, None)
            # Compared with their types: 0 (top_k) is neutral but logprobs=0 asks for logprobs.
            if not any(value == n and type(value) is type(n) for n in neutral):
                raise not_supported_yet(name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true", "stream_options")

    def sampling(self, max_tokens: int | None) -> llm_pb2.SamplingParams:
        params = llm_pb2.SamplingParams(ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids)
        if self.temperature is not None:
            params.temperature = self.temperature
        if max_tokens is not None:
            params.max_tokens = max_tokens
        if self.seed is not None:
            params.seed = self.seed
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def generate_request(self, request_id: str) -> llm_pb2.GenerateRequest:
        request = llm_pb2.GenerateRequest(request_id=request_id, sampling=self.sampling(self.max_tokens))
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise bad_request("several prompts in one request are not supported by this server yet; "
                                  "send one request per prompt", "prompt", "unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)  # out-of-range ids: the scheduler answers 400
        return request


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name, preferred when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras for the template: e.g. {"enable_thinking": false} for Qwen3.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def chat_request(self, request_id: str) -> llm_pb2.ChatRequest:
        """The scheduler's Chat call: it writes the conversation out with the model's template."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        request = llm_pb2.ChatRequest(request_id=request_id, messages=chat_messages(self.messages),
                                      sampling=self.sampling(limit), add_generation_prompt=self.add_generation_prompt)
        request.chat_template_kwargs.update(self.chat_template_kwargs)
        return request


def chat_messages(messages: list[dict[str, Any]]) -> list[llm_pb2.ChatMessage]:
    """Messages as the Chat call takes them: a role each, content as one string (text parts
    joined with newlines, as vLLM joins them)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] has no `role`", "messages")
        content = message.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
            content = "\n".join(str(part.get("text", "")) for part in content)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(llm_pb2.ChatMessage(role=message["role"], content=content or ""))
    return out


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template first."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def tokenize_request(self) -> llm_pb2.TokenizeRequest:
        """The scheduler's Tokenize call for the messages, through the chat template."""
        request = llm_pb2.TokenizeRequest(messages=chat_messages(self.messages),
                                          add_generation_prompt=self.add_generation_prompt)
        request.chat_template_kwargs.update(self.chat_template_kwargs)
        return request


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: dict[int, FinishReason] = {llm_pb2.FINISH_REASON_STOP: "stop",
                                           llm_pb2.FINISH_REASON_LENGTH: "length",
                                           llm_pb2.FINISH_REASON_CANCELLED: "abort"}


def usage_json(usage: llm_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}
