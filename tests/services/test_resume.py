"""GenerateRequest.resume through real processes on CPU: a stream cut after any of its messages and
resumed (as a client does on another replica) gives what the undisturbed stream gave, message for
message joined: tokens, text, logprobs, finish and stop reasons, usage counts; and bad resumes are
INVALID_ARGUMENT naming the completion."""
from pathlib import Path

import grpc
import pytest

from nanoserve.client import Client, Completion, gather, make_request
from nanoserve.v1 import llm_pb2
from tests.services.processes import running_service, wait_idle

FLAGS = ("--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "64")
PROMPT = "The sea is calm tonight, and the"
SEEDED = {"temperature": 0.9, "seed": 7, "top_k": 50}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("resume") / "services.log"
    with running_service(Path(tiny_model_dir), log, worker_flags=FLAGS) as service, \
            Client(service["address"]) as c:
        yield c


def resumed_after(client: Client, request: llm_pb2.GenerateRequest, messages: list[llm_pb2.GenerateResponse],
                  cut: int) -> list[llm_pb2.GenerateResponse]:
    """The first `cut` messages, then the rest from a resume of what they carried (as a client whose
    stream broke there sends it)."""
    received = gather(messages[:cut])
    resumed = llm_pb2.GenerateRequest()
    resumed.CopyFrom(request)
    n = request.sampling.n or 1
    got = {c.index: c for c in received}
    for index in range(n):
        completion = got.get(index, Completion(index=index))
        if not completion.finish_reason:
            resumed.resume.add(index=index, token_ids=completion.token_ids, text=completion.text)
    return messages[:cut] + list(client.stub.Generate(resumed, timeout=60))


def same(got: list[Completion], want: list[Completion]) -> None:
    """Equal in all a client reads; logprobs to float precision (a recompute is a prefill, the
    undisturbed run a decode), the rest exactly."""
    assert [c.index for c in got] == [c.index for c in want]
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                        w.stop_reason)
        assert (g.usage.prompt_tokens, g.usage.completion_tokens) == (w.usage.prompt_tokens, w.usage.completion_tokens)
        assert len(g.logprobs) == len(w.logprobs) and len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(g.logprobs + g.prompt_logprobs, w.logprobs + w.prompt_logprobs):
            assert [a.token.token_id, *(t.token_id for t in a.top)] == [b.token.token_id, *(t.token_id for t in b.top)]
            assert a.token.logprob == pytest.approx(b.token.logprob, abs=1e-4)


def check_every_cut(client: Client, request: llm_pb2.GenerateRequest) -> list[llm_pb2.GenerateResponse]:
    """The undisturbed stream's messages, after checking a resume after each of them."""
    messages = list(client.stub.Generate(request, timeout=60))
    want = gather(messages)
    assert len(messages) > 2
    for cut in range(1, len(messages)):
        same(gather(resumed_after(client, request, messages, cut)), want)
    return messages


def test_a_seeded_stream_with_penalties_and_min_tokens_resumes_identically(client):
    request = make_request(PROMPT, max_tokens=16, min_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.4, logprobs=2, prompt_logprobs=1, **SEEDED)
    want = gather(check_every_cut(client, request))
    assert len(want[0].token_ids) >= 12 and len(want[0].prompt_logprobs) > 0


def test_stop_strings_held_back_at_the_cut_come_after_it(client):
    """The stop string spans two tokens of the undisturbed text: the first's message holds its part
    back, and a resume after it sends that text first; the output still ends where it completes."""
    free = list(client.stub.Generate(make_request(PROMPT, max_tokens=16, ignore_eos=True, **SEEDED), timeout=60))
    texts = [m.text for m in free]
    at = next(i for i in range(len(texts) // 2, len(texts) - 1) if len(texts[i]) > 1 and texts[i + 1])
    stop = texts[at][-2:] + texts[at + 1][0]
    request = make_request(PROMPT, max_tokens=16, ignore_eos=True, stop=[stop], **SEEDED)
    messages = check_every_cut(client, request)
    assert any(m.token_ids and not m.text for m in messages)  # text was held back at a cut
    assert gather(messages)[0].stop_reason == stop


def test_two_completions_resume_each_from_its_own_tokens(client):
    """n = 2 with different lengths: cuts after the shorter finished leave it out of the resume."""
    request = make_request(PROMPT, n=2, max_tokens=10, min_tokens=3, stop_token_ids=[], logprobs=1, **SEEDED)
    want = check_every_cut(client, request)
    assert want[0].token_ids != want[1].token_ids


def test_greedy_chat_resumes_identically(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    want = gather(client.chat_stream(messages, max_tokens=16, temperature=0, ignore_eos=True))
    first = want[0]
    resumed = llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(**m) for m in messages],
                                  sampling=llm_pb2.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    resumed.resume.add(index=0, token_ids=first.token_ids[:5])  # and no text: all of theirs comes again
    rest = gather(client.stub.Chat(resumed, timeout=60))[0]
    assert (first.token_ids[:5] + rest.token_ids, rest.text) == (first.token_ids, first.text)
    assert rest.usage.completion_tokens == 16


@pytest.mark.parametrize("resume, error", [
    ({"index": 2}, "resume: completion 2 does not exist: the request asks for n = 2"),
    ({"index": 0, "token_ids": [1] * 8}, "resume: completion 0 carries 8 tokens and max_tokens is 8: it had finished"),
    ({"index": 1, "token_ids": [10**7]}, "resume: completion 1: token id 10000000 is outside the vocabulary"),
    ({"index": 0, "token_ids": [785], "text": "not its text"}, "resume: completion 0's text is not what its tokens"),
])
def test_bad_resumes_are_invalid_arguments(client, resume, error):
    wait_idle(client)  # an earlier test's requests may still be ending
    request = make_request(PROMPT, n=2, max_tokens=8)
    request.resume.add(**resume)
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error in info.value.details()
    assert client.stats().num_waiting == client.stats().num_running == 0
