"""OpenAI request bodies (with vLLM's extra sampling fields), checked and turned into gRPC.

The body's types are checked here; the values' ranges are the scheduler's to check (its
INVALID_ARGUMENT message names the field, and the error names the request's parameter for it).
What the scheduler cannot do (best_of above n, suffix, echo in chat) is refused with a 400 naming
the parameter, so a client never gets silently different output. Structured output and tools:
structured.py.
"""
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gateway_svc import structured
from gateway_svc.errors import bad_request, unsupported
from gateway_svc.responses import Echo, Output
from nanoserve.v1 import llm_pb2

TokenId = Annotated[int, Field(ge=0, lt=2**32)]
Count = Annotated[int, Field(ge=0, lt=2**32)]        # a uint32 field: its range is the scheduler's to check
Int32 = Annotated[int, Field(ge=-2**31, lt=2**31)]
# SamplingParams fields sent when the request sets them, under the same name.
_OPTIONAL_FIELDS = ("temperature", "seed", "n", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share. Unknown fields are ignored, as vLLM ignores them."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    temperature: float | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    n: Count | None = None
    best_of: int | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> added to its logit
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: Count | None = None         # vLLM's: scores of the prompt's tokens (whole responses only)
    return_token_ids: bool = False               # vLLM's: each choice (and each streamed event) gives its token ids
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object, ...

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true", "stream_options")
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise unsupported("best_of", f"`best_of` must equal `n` ({n}) on this server: it returns every "
                                         f"completion it draws and does not rank them; ask for `n` completions")
        if self.stream and self.prompt_logprobs is not None:
            raise bad_request("`prompt_logprobs` is not available when `stream` is true", "prompt_logprobs")

    def sampling(self, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None) -> llm_pb2.SamplingParams:
        params = llm_pb2.SamplingParams(ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                                        stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                                        include_stop_str_in_output=self.include_stop_str_in_output,
                                        logit_bias=self._token_bias())
        chosen = {name: getattr(self, name) for name in _OPTIONAL_FIELDS}
        chosen.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for name, value in chosen.items():
            if value is not None:
                setattr(params, name, value)
        constraint = self.constraint()
        if constraint is not None:
            params.structured_outputs.CopyFrom(constraint)
        return params

    def constraint(self) -> llm_pb2.StructuredOutputs | None:
        return None if self.structured_outputs is None else structured.structured_outputs(self.structured_outputs)

    def _token_bias(self) -> dict[int, float]:
        """logit_bias with OpenAI's string keys as token ids (their range is the scheduler's to check)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                token_id = -1
            if not 0 <= token_id < 2**32:
                raise bad_request(f"logit_bias keys must be token ids (integers >= 0 written as strings), got {key!r}",
                                  "logit_bias")
            bias[token_id] = value
        return bias


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Count | None = None              # the N most likely alternatives of each token, with its own
    echo: bool | None = None                   # the prompt before each choice's text (and its logprobs)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported("suffix", "`suffix` (text after the completion) is not supported by this server")

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt's tokens are scored too (through prompt_logprobs)."""
        return bool(self.echo) and self.logprobs is not None

    def generate_request(self) -> llm_pb2.GenerateRequest:
        prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0) if self.scores_prompt else self.prompt_logprobs
        request = llm_pb2.GenerateRequest(sampling=self.sampling(self.max_tokens, self.logprobs, prompt_logprobs))
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise bad_request("several prompts in one request are not supported by this server; "
                                  "send one request per prompt (or ask for `n` completions of one)", "prompt",
                                  "unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)  # out-of-range ids: the scheduler answers 400
        return request

    def output(self, echo: Echo | None) -> Output:
        return Output(n=self.n or 1, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, echo=echo,
                      token_ids=self.return_token_ids)

    def param_names(self) -> dict[str, str]:
        """The request's parameter behind each SamplingParams field its errors may name."""
        return {"prompt_logprobs": "logprobs"} if self.scores_prompt and self.prompt_logprobs is None else {}


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name, preferred when both are set
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    echo: bool | None = None  # vLLM's: the reply continues the conversation's last message
    # vLLM's extras for the template: e.g. {"enable_thinking": false} for Qwen3.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def check_supported(self) -> None:
        super().check_supported()
        if self.structured_outputs is not None and structured.response_format(self.response_format) is not None:
            raise bad_request("set either `response_format` or `structured_outputs`, not both", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
        if self.echo:
            raise unsupported("echo", "`echo` (continuing the last message) is not supported by this server's chat")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def constraint(self) -> llm_pb2.StructuredOutputs | None:
        return super().constraint() or structured.response_format(self.response_format)

    def chat_request(self) -> llm_pb2.ChatRequest:
        """The scheduler's Chat call: it writes the conversation out with the model's template."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        request = llm_pb2.ChatRequest(messages=chat_messages(self.messages),
                                      sampling=self.sampling(limit, self.num_logprobs, self.prompt_logprobs),
                                      add_generation_prompt=self.add_generation_prompt,
                                      tools=structured.tools(self.tools), tool_choice=structured.tool_choice(self.tool_choice),
                                      parallel_tool_calls=self.parallel_tool_calls)
        request.chat_template_kwargs.update(self.chat_template_kwargs)
        return request

    def output(self) -> Output:
        return Output(n=self.n or 1, logprobs=self.num_logprobs, prompt_logprobs=self.prompt_logprobs,
                      token_ids=self.return_token_ids)

    def param_names(self) -> dict[str, str]:
        """The request's parameter behind each SamplingParams field its errors may name."""
        names = {"logprobs": "top_logprobs"}
        if self.response_format is not None:
            names["structured_outputs"] = "response_format"
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


def chat_messages(messages: list[dict[str, Any]]) -> list[llm_pb2.ChatMessage]:
    """Messages as the Chat call takes them: a role each, content as one string (text parts
    joined with newlines, as vLLM joins them), an assistant's tool calls, a tool result's call id."""
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
        out.append(llm_pb2.ChatMessage(role=message["role"], content=content or "",
                                       tool_calls=structured.message_tool_calls(message, i),
                                       tool_call_id=str(message.get("tool_call_id") or "")))
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
