"""/v1/chat/completions: the conversation goes through the model's own chat template (checked
against transformers' apply_chat_template) and generates like the rendered text over gRPC."""
import httpx
import pytest
from transformers import AutoTokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rendered(hf_tokenizer, messages, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_chat_generates_from_the_templated_prompt(oai, grpc_client, hf_tokenizer, model_name):
    prompt = rendered(hf_tokenizer, MESSAGES)
    want = grpc_client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    got = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text and want.text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(hf_tokenizer(prompt)["input_ids"]), 12)


def test_template_kwargs_reach_the_template(oai, grpc_client, hf_tokenizer, model_name):
    prompt = rendered(hf_tokenizer, MESSAGES, enable_thinking=False)
    assert prompt != rendered(hf_tokenizer, MESSAGES)
    want = grpc_client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True)
    got = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_chat_stream_opens_with_the_role_and_ends_with_usage(oai, grpc_client, hf_tokenizer, model_name):
    want = grpc_client.generate(rendered(hf_tokenizer, MESSAGES), max_tokens=16, temperature=0, ignore_eos=True)
    chunks = list(oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_text_content_parts_are_joined(oai, grpc_client, hf_tokenizer, model_name):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    want = grpc_client.generate(rendered(hf_tokenizer, [{"role": "user", "content": "Name\na colour."}]),
                                max_tokens=4, temperature=0, ignore_eos=True)
    got = oai.chat.completions.create(model=model_name, messages=parts, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_tokenize_and_detokenize_in_vllms_shapes(gateway, grpc_client, hf_tokenizer, model_name):
    text = "Hello, wörld! 你好"
    got = httpx.post(gateway + "/tokenize", json={"model": model_name, "prompt": text}).json()
    assert got["tokens"] == grpc_client.tokenize(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == grpc_client.model_info().max_model_len
    back = httpx.post(gateway + "/detokenize", json={"model": model_name, "tokens": got["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(gateway + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == hf_tokenizer(rendered(hf_tokenizer, MESSAGES))["input_ids"]
    bad = httpx.post(gateway + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
