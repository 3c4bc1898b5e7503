"""Incremental detokenization: turns a stream of token ids into text without broken characters.

Byte-level BPE splits multi-byte UTF-8 characters (CJK, emoji) across tokens, so decoding
token by token would emit U+FFFD halves. Following vLLM and TGI, only a short window of
recent tokens is kept and decoded: its first `read` tokens have had their text emitted
already and stay as context (so decoders that strip a leading space do so identically in
both decodes below); the tokens after them are pending. Pending text is released once it
no longer ends in U+FFFD, i.e. once its last character is complete.
"""
from typing import Callable

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one sequence's tokens as they arrive; each push costs O(new tokens)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._window: list[int] = []
        self._read = 0  # window[:read] is emitted context, window[read:] is pending

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens and returns the text they complete (possibly empty)."""
        self._window.extend(token_ids)
        emitted, text = self._decode_window()
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT_CHAR):
            return ""  # no text yet, or the last character still waits for its bytes
        del self._window[:self._read]  # the pending tokens become the next context
        self._read = len(self._window)
        return text[len(emitted):]

    def flush(self) -> str:
        """Returns whatever is still held back; call once, when the stream ends."""
        emitted, text = self._decode_window()
        self._window.clear()
        self._read = 0
        return text[len(emitted):]

    def _decode_window(self) -> tuple[str, str]:
        """The window's text up to `read` (already emitted) and up to its end."""
        return self._decode(self._window[:self._read]), self._decode(self._window)
