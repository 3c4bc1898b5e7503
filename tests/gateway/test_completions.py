"""/v1/completions through the official `openai` client: text, usage and streams against the
same request sent to the scheduler over gRPC."""
import json

import httpx

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_greedy_text_equals_the_same_request_over_grpc(oai, grpc_client, model_name):
    want = grpc_client.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    got = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=20, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert got.object == "text_completion" and got.model == model_name and got.id.startswith("cmpl-")
    assert [c.text for c in got.choices] == [want.text] and want.text
    assert got.choices[0].finish_reason == "length"
    u = got.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (want.usage.prompt_tokens, 20,
                                                                       want.usage.prompt_tokens + 20)
    assert u.prompt_tokens == len(grpc_client.tokenize(PROMPT))


def test_token_id_prompt_and_default_max_tokens(oai, grpc_client, model_name):
    ids = [(i * 7919) % 150000 for i in range(1, 30)]
    got = oai.completions.create(model=model_name, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    want = grpc_client.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)
    assert got.choices[0].text == want.text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 16)  # OpenAI's default of 16


def test_stream_carries_the_same_text_and_usage_only_when_asked(oai, grpc_client, model_name):
    want = grpc_client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    chunks = list(oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert len([c for c in chunks if c.choices]) > 2  # tokens arrive as they are made, not at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
    plain = list(oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert all(c.choices and c.usage is None for c in plain)


def test_stream_is_server_sent_events_ending_with_done(gateway, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in events[:-1])


def test_same_seed_same_text_other_seed_other_text(oai, model_name):
    def sample(seed: int) -> str:
        return oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                      seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_model_is_accepted_by_its_listed_id_its_path_and_its_name(oai, gateway, tiny_model_dir, model_name):
    listed = oai.models.list().data
    assert [m.id for m in listed] == [model_name]
    for name in (model_name, str(tiny_model_dir)):
        got = oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert got.model == model_name and got.usage.completion_tokens <= 2


def test_return_token_ids_gives_the_grpc_token_ids_whole_and_streamed(oai, grpc_client, model_name):
    """vLLM's return_token_ids: each choice (whole) and each event (streamed) carries its token ids,
    which add up to the tokens the same request generates over gRPC; without it, none are sent."""
    want = grpc_client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    whole = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == want.token_ids and len(want.token_ids) == 12
    chunks = list(oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "return_token_ids": True}))
    streamed = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices]
    assert sum(streamed, []) == want.token_ids and len(streamed) > 2
    plain = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra
    chat = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(chat.choices[0].model_extra["token_ids"]) == 5
