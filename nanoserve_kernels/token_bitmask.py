"""Grammar masks on logits, in plain torch: the CPU path, and the oracle for the Triton kernel
(nanoserve_kernels/triton_token_bitmask.py).

A mask row is the grammar engine's bitmask (llguidance's and xgrammar's layout): int32 words, bit j of
word w allowing token 32 w + j. Tokens a row's mask leaves out get -inf, in place, before any other
logits processor and the draw, so neither temperature nor top-k/top-p can bring them back. A draw with no other
processor takes the masks into the sampling kernel itself (TokenMasks), rather than in a launch of
their own."""
from typing import NamedTuple

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one mask row."""
    return (vocab_size + 31) // 32


class TokenMasks(NamedTuple):
    """Masks for a draw: row i of the logits keeps the tokens table[rows[i]] allows, or every token
    where rows[i] < 0 (an unconstrained sequence)."""
    table: torch.Tensor  # [table rows, bitmask_words(vocab)] int32
    rows: torch.Tensor   # [logits rows] int64


def masked_copy(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """logits with `masks` applied, in a copy (the reference for a draw that takes masks)."""
    masked = torch.nonzero(masks.rows >= 0).flatten()
    logits = logits.clone()
    apply_token_bitmask(logits, masks.table, masks.rows[masked], masked)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor,
                        rows: torch.Tensor | None) -> None:
    """logits [batch, vocab]: row rows[i] keeps only the tokens bitmask[mask_rows[i]] allows (bitmask
    [table rows, bitmask_words(vocab)] int32, mask_rows and rows int64, all on the logits' device);
    rows None: every row, row i masked by bitmask[mask_rows[i]]. The mask rows index a table (the
    sampling rank's per-slot masks), so a step's rows need no gathering first."""
    vocab_size = logits.shape[1]
    # Little-endian words: byte k of a row holds tokens 8k .. 8k + 7, lowest bit first.
    words = bitmask[mask_rows]
    allowed = _BYTE_BITS.to(logits.device)[words.view(torch.uint8).long()].reshape(len(words), -1)
    rows = slice(None) if rows is None else rows
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))


# Each byte value's 8 bits, lowest first.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
