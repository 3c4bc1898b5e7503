"""Stop strings over adversarial splits: whatever pieces the text (or the tokens) arrive in, the
streamed text is the text before the first stop string (or through it, when asked), never a
character of the stop string leaks before it is ruled out, and the completion's tokens end at
the one that completed it. Real Qwen3 tokenizer for the token-level checks."""
import pytest
from hypothesis import given, settings, strategies as st

from nanoserve.v1 import llm_pb2
from nanoserve_cli.cache import cache_dir
from nanoserve_cli.demo_model import fetch_qwen3_tokenizer
from scheduler_svc.completions import CompletionOutput
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.stop_strings import StopStrings
from scheduler_svc.tokenizer import TextTokenizer

TOKENIZER_CACHE = cache_dir() / "tokenizer-qwen3"


def expected(text: str, stops: tuple[str, ...], include: bool, boundaries: list[int]) -> tuple[str, str | None]:
    """The plain reference: the first piece boundary by which some stop string appears; of those
    in the text so far, the earliest (the shorter of two starting alike)."""
    for end in boundaries:
        found = [(text[:end].find(stop), len(stop), stop) for stop in stops if stop in text[:end]]
        if found:
            start, _, stop = min(found)
            return text[:start] + (stop if include else ""), stop
    return text, None


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab c", max_size=24), stops=st.lists(st.text("ab c", min_size=1, max_size=4), min_size=1,
                                                          max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=12), include=st.booleans())
def test_pieces_stream_the_text_before_the_first_stop_string(text, stops, cuts, include):
    stops = tuple(stops)
    pieces = split(text, cuts)
    boundaries = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
    want_text, want_stop = expected(text, stops, include, boundaries)
    matcher, streamed, stop = StopStrings(stops, include), "", None
    for piece in pieces:
        out, stop = matcher.push(piece)
        streamed += out
        assert want_text.startswith(streamed)  # nothing streamed that the end result lacks
        if not include:
            assert not any(s in streamed for s in stops)
        if stop is not None:
            break
    if stop is None:
        streamed += matcher.flush()
    assert (streamed, stop) == (want_text, want_stop)


def test_held_text_is_only_what_could_still_become_a_stop_string():
    matcher = StopStrings(("</end>",), include_in_output=False)
    assert matcher.push("hello </") == ("hello ", None)
    assert matcher.push("e") == ("", None)
    assert matcher.push("x") == ("</ex", None)  # ruled out: released at once
    assert matcher.push("t </end> more") == ("t ", "</end>")


def test_an_unarmed_matcher_lets_stop_strings_through_but_holds_their_starts():
    matcher = StopStrings(("ab",), include_in_output=False)
    assert matcher.push("xab a", armed=False) == ("xab ", None)
    assert matcher.push("b", armed=True) == ("", "ab")  # completed once armed: it counts


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    fetch_qwen3_tokenizer(TOKENIZER_CACHE)
    return TextTokenizer(TOKENIZER_CACHE)


def run_completion(tokenizer: TextTokenizer, token_ids: list[int], groups: list[int], **options):
    """Delivers `token_ids` in groups of the given sizes, cycled (the last group finishing the
    sequence, unless a stop string ends it first); returns the messages."""
    seq = Sequence(1, [1, 2, 3], SamplingOptions(**options))
    stream = RequestStream(seq)
    output = CompletionOutput(stream, tokenizer, "req")
    messages, start = [], 0
    for size in groups * len(token_ids):
        chunk = token_ids[start:start + size]
        start += size
        seq.completion_token_ids.extend(chunk)
        stream.new_tokens.extend(chunk)
        if start >= len(token_ids):
            stream.finished, seq.finish_reason = True, "length"
        if (message := output.next_message()) is not None:
            messages.append(message)
        if output.done:
            break
    return messages


TEXT = "Le café 東京で寿司を食べました 🦀🧬 done. Ελληνικά!"


@pytest.mark.parametrize("stop", ["寿司", "🧬", "司を食", "é 東", " done", "!"])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("groups", [[1], [2, 1], [3], [7], [100]])
def test_tokens_end_at_the_one_completing_a_stop_string_whatever_their_grouping(tokenizer, stop, include, groups):
    ids = tokenizer.encode(TEXT)
    messages = run_completion(tokenizer, ids, groups, stop=(stop,), include_stop_str_in_output=include)
    text = "".join(m.text for m in messages)
    assert text == TEXT[:TEXT.index(stop)] + (stop if include else "")
    tokens = [t for m in messages for t in m.token_ids]
    completing = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    assert tokens == ids[:completing]
    last = messages[-1]
    assert (last.finish_reason, last.stop_string, last.usage.completion_tokens) == \
        (llm_pb2.FINISH_REASON_STOP, stop, completing)
    assert all("\ufffd" not in m.text for m in messages)


def test_a_stop_string_before_min_tokens_does_not_end_the_output(tokenizer):
    ids = tokenizer.encode("ab ab ab")  # "ab" completed by the first token already
    messages = run_completion(tokenizer, ids, [1], stop=(" ab",), min_tokens=len(ids))
    assert "".join(m.text for m in messages) == "ab ab"
    assert messages[-1].stop_string == " ab"


def test_without_a_match_everything_arrives_and_the_finish_is_the_sequences(tokenizer):
    ids = tokenizer.encode(TEXT)
    messages = run_completion(tokenizer, ids, [2], stop=("zzz", "ıı"))
    assert "".join(m.text for m in messages) == TEXT
    assert (messages[-1].finish_reason, messages[-1].WhichOneof("stop_reason")) == (llm_pb2.FINISH_REASON_LENGTH, None)
