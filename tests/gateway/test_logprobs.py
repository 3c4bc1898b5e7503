"""Log probabilities through the gateway, whole and streamed, equal the gRPC API's for the same
seeded request (the scheduler's logprobs are checked against transformers by the gRPC tests):
completions' legacy object, chat's content list, echo's scored prompt and vLLM's prompt_logprobs."""
import httpx
import pytest

from nanoserve.client import gather
from tests.gateway.answers import ask

PROMPT = "The sea is calm tonight, and the"
MESSAGES = [{"role": "user", "content": "Write about the sea."}]
SEEDED = {"temperature": 0.8, "seed": 3, "ignore_eos": True}


def offsets(tokens: list[str], start: int = 0) -> list[int]:
    out = []
    for token in tokens:
        out.append(start)
        start += len(token)
    return out


def legacy(rows, num_top: int) -> dict:
    """What completions' logprobs object holds for gRPC rows: each token's text and logprob, and
    its top alternatives' texts and logprobs with the token's own."""
    tokens = [row.token.text for row in rows]
    top = [{t.text: t.logprob for t in reversed([*row.top[:num_top], row.token])} for row in rows]
    return {"tokens": tokens, "token_logprobs": [row.token.logprob for row in rows], "top_logprobs": top,
            "text_offset": offsets(tokens)}


def assert_legacy_equal(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-6)
    assert len(got["top_logprobs"]) == len(want["top_logprobs"])
    for got_top, want_top in zip(got["top_logprobs"], want["top_logprobs"]):
        assert got_top == (want_top if want_top is None else pytest.approx(want_top, abs=1e-6))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_are_the_grpc_ones(oai, grpc_client, model_name, stream):
    want = grpc_client.generate_n(PROMPT, n=2, max_tokens=8, logprobs=3, **SEEDED)
    got = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, n=2, max_tokens=8, logprobs=3, **SEEDED)
    assert got.texts == [c.text for c in want]
    for choice, completion in zip(got.choices, want):
        assert len(completion.logprobs) == 8 and {len(row.top) for row in completion.logprobs} == {3}
        assert_legacy_equal(choice.logprobs, legacy(completion.logprobs, 3))
        assert all(len(top) in (3, 4) for top in choice.logprobs["top_logprobs"])  # OpenAI's up to N + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("top_logprobs", [None, 2])
def test_chat_logprobs_are_the_grpc_ones(oai, grpc_client, model_name, stream, top_logprobs):
    want = grpc_client.chat(MESSAGES, max_tokens=6, logprobs=top_logprobs or 0, **SEEDED)
    params = {} if top_logprobs is None else {"top_logprobs": top_logprobs}
    got = ask(oai, "chat", stream, model=model_name, messages=MESSAGES, max_completion_tokens=6, logprobs=True,
              **params, **SEEDED)
    content = got.choices[0].logprobs
    assert got.texts == [want.text] and len(content) == len(want.logprobs) == 6

    def entry(logprob) -> dict:
        # float32 logits: a batch of another shape (another test's request beside it) sums in another order
        return {"token": logprob.text, "logprob": pytest.approx(logprob.logprob, rel=1e-5, abs=1e-5),
                "bytes": list(logprob.text.encode())}

    assert content == [{**entry(row.token), "top_logprobs": [entry(t) for t in row.top]} for row in want.logprobs]
    assert {len(e["top_logprobs"]) for e in content} == {top_logprobs or 0}


def test_without_logprobs_there_are_none(oai, model_name):
    for stream in (False, True):
        for endpoint, prompt in (("completions", {"prompt": PROMPT}), ("chat", {"messages": MESSAGES})):
            got = ask(oai, endpoint, stream, model=model_name, max_tokens=3, **prompt, **SEEDED)
            assert got.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_writes_and_scores_the_prompt_first(oai, grpc_client, model_name, stream):
    ids = grpc_client.tokenize(PROMPT)
    want = grpc_client.generate(ids, max_tokens=3, logprobs=2, prompt_logprobs=2, **SEEDED)
    assert len(want.prompt_logprobs) == len(ids) - 1
    got = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True,
              **SEEDED)
    assert got.texts == [PROMPT + want.text]
    first = grpc_client.detokenize(ids[:1])
    scored = legacy([*want.prompt_logprobs, *want.logprobs], 2)
    expected = {"tokens": [first, *scored["tokens"]], "token_logprobs": [None, *scored["token_logprobs"]],
                "top_logprobs": [None, *scored["top_logprobs"]], "text_offset": offsets([first, *scored["tokens"]])}
    assert_legacy_equal(got.choices[0].logprobs, expected)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 3


def test_echo_of_token_ids_writes_their_text(oai, grpc_client, model_name):
    ids = grpc_client.tokenize("Echo this, please.")
    want = grpc_client.generate(ids, max_tokens=4, **SEEDED)
    for stream in (False, True):
        got = ask(oai, "completions", stream, model=model_name, prompt=ids, max_tokens=4, echo=True, **SEEDED)
        assert got.texts == ["Echo this, please." + want.text] and got.choices[0].logprobs is None


def test_prompt_logprobs_in_vllms_shape(gateway, grpc_client, model_name):
    ids = grpc_client.tokenize(PROMPT)
    want = grpc_client.generate(ids, max_tokens=2, prompt_logprobs=1, **SEEDED)
    expected = [None] + [{str(t.token_id): {"logprob": pytest.approx(t.logprob, abs=1e-6), "rank": t.rank,
                                            "decoded_token": t.text} for t in (row.top[0], row.token)}
                         for row in want.prompt_logprobs]
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, **SEEDED}
    got = httpx.post(gateway + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["prompt_logprobs"] == expected
    chat_want = gather(grpc_client.chat_stream(MESSAGES, max_tokens=2, prompt_logprobs=0, **SEEDED))[0]
    chat = httpx.post(gateway + "/v1/chat/completions", timeout=60,
                      json={"model": model_name, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0,
                            **SEEDED}).json()
    assert chat["prompt_logprobs"] == [None] + [
        {str(row.token.token_id): {"logprob": pytest.approx(row.token.logprob, abs=1e-6), "rank": row.token.rank,
                                   "decoded_token": row.token.text}} for row in chat_want.prompt_logprobs]
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
