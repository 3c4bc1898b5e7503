"""A thin typed Python client for the public nanoserve.v1.LLM API."""
from dataclasses import dataclass, field
from typing import Iterator

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
    """Everything a finished Generate stream carried."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: llm_pb2.Usage | None = None


class Client:
    """The public API of the server at `address` (host[:port]); `tls` for a server that serves TLS."""

    def __init__(self, address: str = DEFAULT_ADDRESS, tls: TLSFiles = TLSFiles()):
        self.address = with_default_port(address)
        self.channel = open_channel(self.address, tls)
        self.stub = llm_pb2_grpc.LLMStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompt: str | list[int], *, max_tokens: int | None = None,
               temperature: float | None = None, ignore_eos: bool = False, seed: int | None = None,
               stop_token_ids: tuple[int, ...] = (), request_id: str = "",
               timeout: float | None = None) -> Iterator[llm_pb2.GenerateResponse]:
        """Yields the server's messages as they arrive; raises grpc.RpcError on failure."""
        request = make_request(prompt, max_tokens=max_tokens, temperature=temperature,
                               ignore_eos=ignore_eos, seed=seed, stop_token_ids=stop_token_ids,
                               request_id=request_id)
        return self.stub.Generate(request, timeout=timeout)

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        """Runs one Generate to the end and gathers it."""
        out = Completion()
        for msg in self.stream(prompt, **kwargs):
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if msg.finish_reason:
                out.finish_reason = llm_pb2.FinishReason.Name(msg.finish_reason)
                out.usage = msg.usage
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(llm_pb2.TokenizeRequest(text=text)).token_ids)

    def model_info(self) -> llm_pb2.ModelInfo:
        return self.stub.GetModelInfo(llm_pb2.GetModelInfoRequest())

    def stats(self) -> llm_pb2.Stats:
        return self.stub.GetStats(llm_pb2.GetStatsRequest())


def make_request(prompt: str | list[int], *, max_tokens: int | None = None,
                 temperature: float | None = None, ignore_eos: bool = False,
                 seed: int | None = None, stop_token_ids: tuple[int, ...] = (),
                 request_id: str = "") -> llm_pb2.GenerateRequest:
    sampling = llm_pb2.SamplingParams(ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids))
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    request = llm_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request

