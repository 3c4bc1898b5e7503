"""The scheduler's logprob rows (TokenLogprob: a token and its most likely alternatives) in the
shapes OpenAI's and vLLM's clients read: completions' legacy object, chat's `content` list and
vLLM's `prompt_logprobs`. Each takes the first `num_top` alternatives of a row, so one call
scored for several of them serves each its own count."""
from collections.abc import Sequence

from nanoserve.v1 import llm_pb2

_FLOOR = -9999.0  # JSON has no -inf: vLLM's value for a token the model rules out


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


class CompletionLogprobs:
    """One choice's legacy `logprobs` object, {tokens, token_logprobs, top_logprobs, text_offset},
    block by block (a stream's chunks, or the whole choice at once). text_offset counts the
    characters of the token texts before each token, as vLLM counts them."""

    def __init__(self, num_top: int):
        self.num_top = num_top
        self.offset = 0

    def block(self, rows: Sequence[llm_pb2.TokenLogprob], unscored: str | None = None) -> dict:
        """The object for `rows`, after `unscored`: a token without a logprob (a prompt's first)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if unscored is not None:
            self._add(out, unscored, None, None)
        for row in rows:
            self._add(out, row.token.text, _value(row.token.logprob), self._top(row))
        return out

    def _add(self, out: dict, token: str, logprob: float | None, top: dict | None) -> None:
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(token)

    def _top(self, row: llm_pb2.TokenLogprob) -> dict[str, float]:
        """The most likely tokens' texts and the chosen token's: OpenAI's up to num_top + 1 entries
        (two tokens of the same text keep the likelier one's value)."""
        top: dict[str, float] = {}
        for alternative in [*row.top[:self.num_top], row.token]:
            top.setdefault(alternative.text, _value(alternative.logprob))
        return top


def chat_content(rows: Sequence[llm_pb2.TokenLogprob], num_top: int) -> list[dict]:
    """Chat's `logprobs.content`: each token with its logprob, its UTF-8 bytes and its alternatives."""
    return [{**_chat_token(row.token), "top_logprobs": [_chat_token(t) for t in row.top[:num_top]]} for row in rows]


def _chat_token(logprob: llm_pb2.Logprob) -> dict:
    # The bytes of the token's text as the scheduler decoded it alone (vLLM's convention: a token
    # holding part of a multi-byte character shows U+FFFD there, not its raw bytes).
    return {"token": logprob.text, "logprob": _value(logprob.logprob), "bytes": list(logprob.text.encode())}


def prompt_logprobs(rows: Sequence[llm_pb2.TokenLogprob], num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing predicts it), then for
    each token {token id: {logprob, rank, decoded_token}} of the token and its alternatives."""
    out: list[dict | None] = [None]
    for row in rows:
        entry: dict[str, dict] = {}
        for logprob in [row.token, *row.top[:num_top]]:
            entry.setdefault(str(logprob.token_id), {"logprob": _value(logprob.logprob), "rank": logprob.rank,
                                                     "decoded_token": logprob.text})
        out.append(entry)
    return out
