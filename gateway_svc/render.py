"""vLLM's render endpoints: the token ids a request would be prefilled with, without generating.

`POST /v1/completions/render` answers a list (one entry per prompt) and
`POST /v1/chat/completions/render` one entry, each in the shape of vLLM's GenerateRequest:
{request_id, token_ids, features, sampling_params, model, stream, stream_options, cache_salt,
priority, kv_transfer_params}. A precise prefix router (llm-d's token producer) hashes these ids
into the blocks it looks up. They are the scheduler's own: a text prompt and a conversation go
through its Tokenize with exactly what Generate and Chat would get, and a token-id prompt is the
prompt itself once it is checked against the vocabulary as the scheduler checks it.
"""
import uuid
from collections.abc import Callable

from fastapi import FastAPI

from gateway_svc.errors import bad_request
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest
from gateway_svc.scheduler_client import SchedulerClient, check_model, model_names
from nanoserve.v1 import llm_pb2


def check_vocabulary(token_ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming the first id outside the vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param)


def sampling_dict(params: llm_pb2.SamplingParams) -> dict:
    """The sampling fields the request set, under their names (vLLM's)."""
    plain = {}
    for field, value in params.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            plain[field.name] = dict(value)
        elif field.is_repeated:
            plain[field.name] = list(value)
        else:
            plain[field.name] = value
    return plain


def add_render_routes(app: FastAPI, client: Callable[[], SchedulerClient], served_model_name: str) -> None:
    async def served(requested: str | None) -> tuple[str, llm_pb2.ModelInfo]:
        info = await client().model_info()
        check_model(requested, info, served_model_name)
        return model_names(info, served_model_name)[0], info

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest):
        body.check_supported()
        model, info = await served(body.model)
        request = body.generate_request()
        if request.WhichOneof("prompt") == "text":
            ids = await client().tokenize(llm_pb2.TokenizeRequest(text=request.text))
        else:
            ids = list(request.token_ids.ids)
            check_vocabulary(ids, info.vocab_size, "prompt")
        return [_generate_request(ids, request.sampling, model, body)]

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(body: ChatCompletionRequest):
        body.check_supported()
        model, _ = await served(body.model)
        chat = body.chat_request()
        conversation = llm_pb2.TokenizeRequest(messages=chat.messages, chat_template_kwargs=chat.chat_template_kwargs)
        if chat.HasField("add_generation_prompt"):
            conversation.add_generation_prompt = chat.add_generation_prompt
        ids = await client().tokenize(conversation)
        return _generate_request(ids, chat.sampling, model, body)


def _generate_request(token_ids: list[int], sampling: llm_pb2.SamplingParams, model: str,
                      body: CompletionRequest | ChatCompletionRequest) -> dict:
    return {"request_id": uuid.uuid4().hex, "token_ids": token_ids, "features": None,
            "sampling_params": sampling_dict(sampling), "model": model, "stream": body.stream,
            "stream_options": body.stream_options.model_dump() if body.stream_options else None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None}
