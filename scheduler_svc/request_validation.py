"""Checks a request and turns it into prompt ids and sampling options, or says what is wrong:
INVALID_ARGUMENT naming the field and the values it takes."""
import math
from dataclasses import dataclass

import grpc

from nanoserve.v1 import llm_pb2, worker_pb2
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.tokenizer import TextTokenizer

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
PENALTY_LIMIT = 2.0       # vLLM's and OpenAI's range for the presence and frequency penalties


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> BadRequest:
    return BadRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class RequestLimits:
    """What this server accepts: the model's, and its own flags'."""
    vocab_size: int
    max_model_len: int
    max_n: int
    max_logprobs: int


def prompt_ids(request: llm_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: RequestLimits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = tokenizer.encode(request.text)
    elif kind == "token_ids":
        ids = request.token_ids.ids[:]  # a slice: upb copies into a list in C, a third faster than list()
        if ids and max(ids) >= limits.vocab_size:  # max in C; the search only for the message
            bad = next(t for t in ids if t >= limits.vocab_size)
            raise _invalid(f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")
    else:
        raise _invalid("the request has no prompt: set `text` or `token_ids`")
    return checked_length(ids, limits)


def checked_length(ids: list[int], limits: RequestLimits) -> list[int]:
    if not ids:
        raise _invalid("the prompt is empty")
    if len(ids) >= limits.max_model_len:
        raise _invalid(f"the prompt has {len(ids)} tokens but the model's length limit is "
                       f"{limits.max_model_len}, which leaves no room to generate")
    return ids


def _number(params: llm_pb2.SamplingParams, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    """The field's value (its default when unset), refused unless in [low, high] ((low, high] with low_open)."""
    if not params.HasField(name):
        return default
    value = getattr(params, name)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else \
            f"{'>' if low_open else '>='} {low:g}"
        raise _invalid(f"{name} must be in {interval}, got {value:g}")
    return value


def _token_id(name: str, token_id: int, vocab_size: int) -> int:
    if token_id >= vocab_size:
        raise _invalid(f"{name}: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
    return token_id


def _count(params: llm_pb2.SamplingParams, name: str, limit: int, flag: str) -> int | None:
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if value > limit:
        raise _invalid(f"{name} must be in [0, {limit}] (this server's {flag}), got {value}")
    return value


def _model_default(defaults: worker_pb2.SamplingDefaults | None, name: str, api_default: float) -> float:
    return getattr(defaults, name) if defaults is not None and defaults.HasField(name) else api_default


def sampling_options(params: llm_pb2.SamplingParams, limits: RequestLimits,
                     defaults: worker_pb2.SamplingDefaults | None = None) -> SamplingOptions:
    """A temperature, top_p or top_k the request leaves unset is the model's default (its
    generation_config.json, as the workers report it), else the API's."""
    vocab_size = limits.vocab_size
    temperature = params.temperature if params.HasField("temperature") else \
        _model_default(defaults, "temperature", 1.0)
    if math.isnan(temperature) or temperature < 0:
        raise _invalid(f"temperature must be a number >= 0 (0 = greedy), got {temperature}")
    if math.isinf(temperature):
        raise _invalid("temperature must be finite")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else None
    if max_tokens == 0:
        raise _invalid("max_tokens must be at least 1 (leave it unset for no limit)")
    stop_token_ids = tuple(_token_id("stop_token_ids", t, vocab_size) for t in params.stop_token_ids)
    top_k = params.top_k if params.HasField("top_k") else int(_model_default(defaults, "top_k", 0))
    if top_k < -1:
        raise _invalid(f"top_k must be -1 or 0 (off) or at least 1, got {top_k}")
    min_tokens = params.min_tokens if params.HasField("min_tokens") else 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _invalid(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {min_tokens}")
    if min_tokens and params.HasField("structured_outputs"):
        raise _invalid("min_tokens cannot be combined with structured_outputs: the grammar says where the output ends")
    for token_id, bias in params.logit_bias.items():
        _token_id("logit_bias", token_id, vocab_size)
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN fails too
            raise _invalid(f"logit_bias of token {token_id} must be in [{-LOGIT_BIAS_LIMIT:g}, "
                           f"{LOGIT_BIAS_LIMIT:g}], got {bias:g}")
    if any(not stop for stop in params.stop):
        raise _invalid("stop strings must not be empty")
    n = params.n if params.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise _invalid(f"n must be in [1, {limits.max_n}] (this server's --max-n), got {n}")
    return SamplingOptions(
        temperature=temperature, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
        seed=params.seed if params.HasField("seed") else None, stop_token_ids=stop_token_ids,
        top_p=_number(params, "top_p", _model_default(defaults, "top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=0 if top_k in (-1, 0) or top_k >= vocab_size else top_k,  # every token: no top-k at all
        min_p=_number(params, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(params, "repetition_penalty", 1.0, 0.0, math.inf, low_open=True),
        presence_penalty=_number(params, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        frequency_penalty=_number(params, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        logit_bias=tuple(sorted(params.logit_bias.items())), min_tokens=min_tokens, stop=tuple(params.stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        logprobs=_count(params, "logprobs", limits.max_logprobs, "--max-logprobs"),
        prompt_logprobs=_count(params, "prompt_logprobs", limits.max_logprobs, "--max-logprobs"), n=n)


def check_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """A max_tokens the model's length limit cannot give is refused, not silently cut short."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise _invalid(f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
                       f"{num_prompt_tokens + max_tokens} in all, but the model's length limit is {max_model_len}: "
                       f"ask for at most {max_model_len - num_prompt_tokens} tokens, or leave max_tokens unset")


def completions_to_generate(resume: list[llm_pb2.ResumedCompletion], options: SamplingOptions,
                            num_prompt_tokens: int, limits: RequestLimits) -> list[llm_pb2.ResumedCompletion]:
    """The completions to generate, in index order, each with what its client has already: a new
    request's all, with nothing; a resumed one's (GenerateRequest.resume) those it lists."""
    if not resume:
        return [llm_pb2.ResumedCompletion(index=index) for index in range(options.n)]
    listed: dict[int, llm_pb2.ResumedCompletion] = {}
    for completion in resume:
        index, tokens = completion.index, completion.token_ids
        where = f"resume: completion {index}"
        if index >= options.n:
            raise _invalid(f"{where} does not exist: the request asks for n = {options.n} (indices 0..{options.n - 1})")
        if index in listed:
            raise _invalid(f"{where} is listed twice")
        if tokens and max(tokens) >= limits.vocab_size:
            bad = next(t for t in tokens if t >= limits.vocab_size)
            raise _invalid(f"{where}: token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")
        if options.max_tokens is not None and len(tokens) >= options.max_tokens:
            raise _invalid(f"{where} carries {len(tokens)} tokens and max_tokens is {options.max_tokens}: it had "
                           "finished; leave finished completions out")
        if num_prompt_tokens + len(tokens) >= limits.max_model_len:
            raise _invalid(f"{where} carries {len(tokens)} tokens after a prompt of {num_prompt_tokens}: it had "
                           f"reached the model's length limit ({limits.max_model_len}); leave finished completions out")
        listed[index] = completion
    return [listed[index] for index in sorted(listed)]
