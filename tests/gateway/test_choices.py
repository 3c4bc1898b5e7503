"""n completions and stop strings through the gateway, whole and streamed: choices by index,
seeded reproducibility, usage over all choices, and text that never shows a stop string."""
import json

import httpx
import pytest

from nanoserve.client import gather
from tests.gateway.answers import ask

PROMPT = "The sea is calm tonight, and the"
MESSAGES = [{"role": "user", "content": "Write about the sea."}]
SEEDED = {"temperature": 1.0, "seed": 7, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_completions_are_the_grpc_ones_by_index_and_reproducible(oai, grpc_client, model_name, stream):
    want = grpc_client.generate_n(PROMPT, n=3, max_tokens=10, **SEEDED)
    got = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, n=3, max_tokens=10, **SEEDED)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert got.texts == [c.text for c in want] and len(set(got.texts)) == 3
    assert [c.finish_reason for c in got.choices] == ["length"] * 3
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want[0].usage.prompt_tokens, 30)
    assert got.usage.total_tokens == got.usage.prompt_tokens + 30
    again = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, n=3, max_tokens=10, **SEEDED)
    assert again.texts == got.texts
    alone = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, max_tokens=10, **SEEDED)
    assert alone.texts == got.texts[:1]  # completion 0 draws what n = 1 would


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_chat_completions_are_the_grpc_ones_by_index(oai, grpc_client, model_name, stream):
    want = gather(grpc_client.chat_stream(MESSAGES, n=2, max_tokens=8, **SEEDED))
    got = ask(oai, "chat", stream, model=model_name, messages=MESSAGES, n=2, max_completion_tokens=8, **SEEDED)
    assert got.texts == [c.text for c in want] and got.texts[0] != got.texts[1]
    assert [c.role for c in got.choices] == ["assistant"] * 2
    assert got.usage.completion_tokens == 16
    if stream:  # each choice opens with its role, before any text
        first_events = [next(ch.choices[0] for ch in got.chunks if ch.choices and ch.choices[0].index == i)
                        for i in (0, 1)]
        assert [(c.delta.role, c.delta.content) for c in first_events] == [("assistant", "")] * 2


def test_streamed_choices_interleave_each_event_one_choice(gateway, model_name):
    body = {"model": model_name, "prompt": PROMPT, "n": 4, "max_tokens": 12, "stream": True, **SEEDED}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    order = [e["choices"][0]["index"] for e in events]
    assert all(len(e["choices"]) == 1 for e in events) and set(order) == {0, 1, 2, 3}
    assert order != sorted(order)  # as the scheduler makes them, not one choice after another
    finishing = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finishing) == [0, 1, 2, 3]


def a_stop_string_across_tokens(grpc_client, prompt: str | list[dict], chat: bool) -> tuple[str, str]:
    """(the greedy text, a stop string made of the last 2 characters of its 4th token and the first 2 of its 5th)."""
    if chat:
        full = grpc_client.chat(prompt, max_tokens=16, temperature=0, ignore_eos=True)
    else:
        full = grpc_client.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
    boundary = len(grpc_client.detokenize(full.token_ids[:4]))
    stop = full.text[boundary - 2:boundary + 2]
    assert len(stop) == 4 and full.text.index(stop) > 0, (full.text, stop)
    return full.text, stop


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_strings_end_the_text_and_never_show(oai, grpc_client, model_name, endpoint, stream):
    prompt = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": PROMPT}
    full, stop = a_stop_string_across_tokens(grpc_client, MESSAGES if endpoint == "chat" else PROMPT,
                                             endpoint == "chat")
    start = full.index(stop)
    for stops, include in ((stop, False), (["\x00never", stop], False), ([stop], True)):
        got = ask(oai, endpoint, stream, model=model_name, max_tokens=16, temperature=0, ignore_eos=True,
                  stop=stops, include_stop_str_in_output=include, **prompt)
        choice = got.choices[0]
        assert choice.text == full[:start] + (stop if include else "")
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        # Streamed, the events' texts add up to exactly that: no part of the stop string was ever sent.


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_token_is_the_stop_reason_and_eos_is_none(oai, grpc_client, model_name, stream):
    greedy = grpc_client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids
    got = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, max_tokens=6, temperature=0,
              stop_token_ids=[greedy[2]])
    assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("stop", greedy[2])
    assert got.usage.completion_tokens == 3
    plain = ask(oai, "completions", stream, model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert plain.choices[0].stop_reason is None
