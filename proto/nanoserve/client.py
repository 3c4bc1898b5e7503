"""A thin typed Python client for the public nanoserve.v1.LLM API."""
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from nanoserve.failover import Failover, ResumingStream
from nanoserve.flags import SCHEDULER_PORT, defaults
from nanoserve.tls import TLSFiles, open_channel
from nanoserve.v1 import llm_pb2, llm_pb2_grpc

DEFAULT_ADDRESS = defaults("generate")["address"]  # where `nanoserve generate` asks


def with_default_port(address: str, port: int = SCHEDULER_PORT) -> str:
    """`address` with the scheduler's port added when it names none ("localhost" -> "localhost:50051";
    gRPC alone would take 443). IPv6 hosts are written in brackets: "[::1]", "[::1]:50051"."""
    host, _, last = address.rpartition(":")
    has_port = last.isdigit() and (not host.count(":") or host.endswith("]"))
    return address if has_port or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) else f"{address}:{port}"


@dataclass
class Completion:
    """Everything one completion's messages of a Generate (or Chat) stream carried."""
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    usage: llm_pb2.Usage | None = None
    logprobs: list[llm_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[llm_pb2.TokenLogprob] = field(default_factory=list)
    tool_calls: list[llm_pb2.ToolCall] = field(default_factory=list)  # Chat with tools: its calls, whole

    def add(self, msg: llm_pb2.GenerateResponse) -> None:
        self.token_ids.extend(msg.token_ids)
        self.text += msg.text
        self.logprobs.extend(msg.logprobs)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        for part in msg.tool_calls:  # a call's first part has its id; the next ones go on with its arguments
            if part.id:
                self.tool_calls.append(llm_pb2.ToolCall(id=part.id, name=part.name, arguments=part.arguments))
            else:
                self.tool_calls[part.index].arguments += part.arguments
        if msg.finish_reason:
            self.finish_reason = llm_pb2.FinishReason.Name(msg.finish_reason)
            self.usage = msg.usage
            kind = msg.WhichOneof("stop_reason")
            self.stop_reason = None if kind is None else getattr(msg, kind)


def gather(messages: Iterator[llm_pb2.GenerateResponse]) -> list[Completion]:
    """A stream's messages as its completions, by index."""
    completions: dict[int, Completion] = {}
    for msg in messages:
        completions.setdefault(msg.index, Completion(index=msg.index)).add(msg)
    return [completions[index] for index in sorted(completions)]


class Client:
    """The public API of the server at `address` (host[:port]); `tls` for a server that serves TLS.

    Several replicas of one model (a list, or comma-separated): calls go to the replica that served
    last (the first, to begin with), and a stream that breaks with UNAVAILABLE resumes on the next
    (failover.py): the caller sees one stream, `on_failover` (and a warning in the log) that it moved."""

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, tls: TLSFiles = TLSFiles(),
                 on_failover: Callable[[Failover], None] | None = None):
        replicas = address.split(",") if isinstance(address, str) else address
        self.addresses = [with_default_port(replica.strip()) for replica in replicas]
        self.channels = [open_channel(replica, tls) for replica in self.addresses]
        self.stubs = [llm_pb2_grpc.LLMStub(channel) for channel in self.channels]
        self.current = 0  # the replica calls go to
        self.on_failover = on_failover

    @property
    def address(self) -> str:
        return self.addresses[self.current]

    @property
    def stub(self) -> llm_pb2_grpc.LLMStub:
        return self.stubs[self.current]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompt: str | list[int], *, request_id: str = "", timeout: float | None = None,
               **sampling) -> Iterator[llm_pb2.GenerateResponse]:
        """Yields the server's messages as they arrive; raises grpc.RpcError on failure.
        `sampling`: SamplingParams fields by name (max_tokens, temperature, top_p, stop, n, ...)."""
        return self._stream("Generate", make_request(prompt, request_id=request_id, **sampling), timeout)

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        """Runs one Generate to the end and gathers it (one completion: n > 1 is generate_n's)."""
        if kwargs.get("n", 1) != 1:
            raise ValueError("generate() gathers one completion; use generate_n() for n > 1")
        return self.generate_n(prompt, **kwargs)[0]

    def generate_n(self, prompt: str | list[int], **kwargs) -> list[Completion]:
        """Runs one Generate to the end; its completions in index order."""
        return gather(self.stream(prompt, **kwargs))

    def chat_stream(self, messages: list[dict], *, request_id: str = "", timeout: float | None = None,
                    add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
                    tools: list[llm_pb2.Tool] = (), tool_choice: llm_pb2.ToolChoice | None = None,
                    **sampling) -> Iterator[llm_pb2.GenerateResponse]:
        """Chat: `messages` as [{"role": ..., "content": ...}] (ChatMessage fields), through the model's
        chat template, with the `tools` it may call as `tool_choice` says."""
        request = llm_pb2.ChatRequest(request_id=request_id, sampling=sampling_params(**sampling),
                                      add_generation_prompt=add_generation_prompt,
                                      messages=[llm_pb2.ChatMessage(**message) for message in messages],
                                      tools=tools, tool_choice=tool_choice)
        request.chat_template_kwargs.update(chat_template_kwargs or {})
        return self._stream("Chat", request, timeout)

    def _stream(self, method: str, request: llm_pb2.GenerateRequest | llm_pb2.ChatRequest,
                timeout: float | None) -> Iterator[llm_pb2.GenerateResponse]:
        """The call itself on one replica; across several, a stream that resumes on the next."""
        if len(self.stubs) == 1:
            return getattr(self.stub, method)(request, timeout=timeout)
        return ResumingStream([getattr(stub, method) for stub in self.stubs], self.addresses, self.current, request,
                              timeout, self._moved)

    def _moved(self, event: Failover) -> None:
        self.current = self.addresses.index(event.to_address)  # later calls too: the broken replica may be gone
        if self.on_failover is not None:
            self.on_failover(event)

    def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        return gather(self.chat_stream(messages, **kwargs))[0]

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(llm_pb2.TokenizeRequest(text=text)).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        request = llm_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request).text

    def model_info(self) -> llm_pb2.ModelInfo:
        return self.stub.GetModelInfo(llm_pb2.GetModelInfoRequest())

    def stats(self) -> llm_pb2.Stats:
        return self.stub.GetStats(llm_pb2.GetStatsRequest())


def sampling_params(**fields) -> llm_pb2.SamplingParams:
    """SamplingParams from its fields by name; a field given as None stays unset (the server's default)."""
    params = llm_pb2.SamplingParams()
    for name, value in fields.items():
        if value is None:
            continue
        if name == "logit_bias":
            params.logit_bias.update(value)
        elif name == "structured_outputs":
            params.structured_outputs.CopyFrom(value)
        elif isinstance(value, (list, tuple)):
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
    return params


def make_request(prompt: str | list[int], *, request_id: str = "", **sampling) -> llm_pb2.GenerateRequest:
    request = llm_pb2.GenerateRequest(request_id=request_id, sampling=sampling_params(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request
