"""Streaming detokenization against the real Qwen3 tokenizer: never a broken character, and the
streamed pieces always add up to decoding everything at once."""
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from nanoserve_cli.cache import cache_dir
from nanoserve_cli.demo_model import fetch_qwen3_tokenizer
from scheduler_svc.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from scheduler_svc.tokenizer import TextTokenizer

TOKENIZER_CACHE = cache_dir() / "tokenizer-qwen3"
MODEL_VOCAB = 151936  # Qwen3's embedding rows: the model may sample ids the tokenizer lacks

# Accents, CJK (Ext. B characters split over several tokens), 4-byte emoji, a ZWJ sequence.
MIXED_TEXT = ("Crème brûlée, naïve café. 東京で寿司を食べました。𠜎𠝹 "
              "emoji: 🦀🧬👩‍🔬 done\n¿Qué tal? Ελληνικά, русский, हिन्दी 🇫🇷")


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    fetch_qwen3_tokenizer(TOKENIZER_CACHE)
    return TextTokenizer(TOKENIZER_CACHE)


def stream(tokenizer: TextTokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    """Pushes `ids` in chunks of the given sizes (cycled), then flushes; returns every piece."""
    detok = tokenizer.new_detokenizer()
    pieces, start, i = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        pieces.append(detok.push(ids[start:start + size]))
        start, i = start + size, i + 1
    return pieces + [detok.flush()]


def test_encode_matches_transformers_and_roundtrips(tokenizer: TextTokenizer) -> None:
    from transformers import AutoTokenizer  # the independent oracle; scheduler_svc never imports it
    reference = AutoTokenizer.from_pretrained(TOKENIZER_CACHE)
    ids = tokenizer.encode(MIXED_TEXT)
    assert ids == reference(MIXED_TEXT)["input_ids"]  # Qwen3 adds no BOS
    assert tokenizer.decode(ids) == MIXED_TEXT
    assert tokenizer.vocab_size == len(reference)


def test_bos_is_prepended_when_the_config_asks(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    shutil.copy(TOKENIZER_CACHE / "tokenizer.json", tmp_path)
    config = {"add_bos_token": True, "bos_token": {"content": "<|endoftext|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with_bos = TextTokenizer(tmp_path)
    assert with_bos.encode("hi") == [151643] + tokenizer.encode("hi")
    assert with_bos.decode(with_bos.encode("hi")) == "hi"  # special tokens are not decoded


def test_mixed_text_splits_characters_across_tokens(tokenizer: TextTokenizer) -> None:
    """Guards the tests below: some single tokens here decode to half a character."""
    ids = tokenizer.encode(MIXED_TEXT)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_streamed_text_has_no_broken_characters(tokenizer: TextTokenizer, seed: int | None) -> None:
    ids = tokenizer.encode(MIXED_TEXT)
    chunk_sizes = [1] if seed is None else [random.Random(seed).randint(1, 5) for _ in range(64)]
    pieces = stream(tokenizer, ids, chunk_sizes)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert "".join(pieces) == MIXED_TEXT


def test_text_waits_for_the_last_byte_of_a_character(tokenizer: TextTokenizer) -> None:
    split_char = tokenizer.encode("𠜎")
    assert len(split_char) > 1
    detok = tokenizer.new_detokenizer()
    assert [detok.push([i]) for i in split_char] == [""] * (len(split_char) - 1) + ["𠜎"]
    assert detok.flush() == ""


def test_flush_releases_an_unfinished_character(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("ok") + tokenizer.encode("𠜎")[:1]
    detok = tokenizer.new_detokenizer()
    assert detok.push(ids) == ""
    assert detok.flush() == tokenizer.decode(ids) == "ok" + REPLACEMENT_CHAR


def test_context_keeps_word_spacing_for_sentencepiece_decoders() -> None:
    """Metaspace decoders drop the space of a decode's first word: mid-stream words keep theirs."""
    sentencepiece = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, "<unk>"))
    sentencepiece.add_special_tokens([AddedToken("</s>", special=True)])  # id 3, decodes to ""
    sentencepiece.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(sentencepiece.decode)
    assert [detok.push([i]) for i in (0, 3, 1)] == ["Hello", "", " world"]
    assert sentencepiece.decode([0, 3, 1]) == "Hello world"


# Byte tokens (ids 0..255) make split characters and invalid bytes common; ids past the
# tokenizer's vocabulary and special tokens decode to nothing.
token_ids = st.one_of(st.integers(0, 255), st.integers(0, MODEL_VOCAB - 1),
                      st.integers(151643, 151668))


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token_ids, max_size=60), chunk_sizes=st.lists(st.integers(1, 4), min_size=1))
def test_random_ids_stream_to_their_full_decode(tokenizer: TextTokenizer, ids: list[int],
                                                chunk_sizes: list[int]) -> None:
    pieces = stream(tokenizer, ids, chunk_sizes)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces[:-1])


def test_each_push_decodes_a_short_window(tokenizer: TextTokenizer) -> None:
    """O(new tokens) per push: the decoded window does not grow with the stream."""
    window_sizes = []

    def recording_decode(ids: list[int]) -> str:
        window_sizes.append(len(ids))
        return tokenizer.decode(ids)

    ids = tokenizer.encode(MIXED_TEXT * 40)
    detok = IncrementalDetokenizer(recording_decode)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == MIXED_TEXT * 40
    assert len(ids) > 1000 and max(window_sizes) <= 8
