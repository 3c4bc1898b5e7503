"""Log probabilities of chosen tokens, from the raw logits (before any processor or temperature,
as vLLM reports them by default): each row's token's logprob and rank, and the row's most likely
tokens."""
from typing import NamedTuple

import torch


class ScoredRows(NamedTuple):
    """Device tensors, one row per scored token."""
    logprobs: torch.Tensor      # [rows] float32
    ranks: torch.Tensor         # [rows] int64, 1 = the most likely token
    top_ids: torch.Tensor       # [rows, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [rows, num_top] float32


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> ScoredRows:
    """logits [rows, vocab] and the token each row scores [rows]; num_top alternatives per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return ScoredRows(chosen[:, 0], ranks, top_ids, top_logprobs)
