"""Checks a GenerateRequest and turns it into prompt ids and sampling options, or says what is wrong."""
import math

import grpc

from nanoserve.v1 import llm_pb2, worker_pb2
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.tokenizer import TextTokenizer


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> BadRequest:
    return BadRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


def prompt_ids(request: llm_pb2.GenerateRequest, tokenizer: TextTokenizer, vocab_size: int,
               max_model_len: int) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = tokenizer.encode(request.text)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise _invalid(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    else:
        raise _invalid("the request has no prompt: set `text` or `token_ids`")
    if not ids:
        raise _invalid("the prompt is empty")
    if len(ids) >= max_model_len:
        raise _invalid(f"the prompt has {len(ids)} tokens but the model's length limit is "
                       f"{max_model_len}, which leaves no room to generate")
    return ids


def sampling_options(params: llm_pb2.SamplingParams, vocab_size: int,
                     defaults: worker_pb2.SamplingDefaults | None = None) -> SamplingOptions:
    """A value the request leaves unset is the model's default (its generation_config.json, as the
    workers report it), else the API's."""
    temperature = (params.temperature if params.HasField("temperature") else
                   defaults.temperature if defaults is not None and defaults.HasField("temperature") else 1.0)
    if math.isnan(temperature) or temperature < 0:
        raise _invalid(f"temperature must be a number >= 0 (0 = greedy), got {temperature}")
    if math.isinf(temperature):
        raise _invalid("temperature must be finite")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else None
    if max_tokens == 0:
        raise _invalid("max_tokens must be at least 1 (leave it unset for no limit)")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise _invalid(f"stop token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return SamplingOptions(temperature=temperature, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                           seed=params.seed if params.HasField("seed") else None,
                           stop_token_ids=tuple(params.stop_token_ids))


def check_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """A max_tokens the model's length limit cannot give is refused, not silently cut short."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise _invalid(f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
                       f"{num_prompt_tokens + max_tokens} in all, but the model's length limit is {max_model_len}: "
                       f"ask for at most {max_model_len - num_prompt_tokens} tokens, or leave max_tokens unset")
