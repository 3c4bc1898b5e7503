"""Triton exponential-race sampling: the tokens of nanoserve_kernels/race_sampling.py (its docstring gives
the method and the noise) in two launches, whatever the mix of greedy, seeded and unseeded rows.

The first kernel splits each row's vocabulary into equal ranges, one program each, so a single row
still fills the GPU: each lane of a program keeps the best score and its token among the entries
it sees, drawing noise only for rows at temperature > 0, and the program reduces its lanes once at
the end (a reduction per block cost a fifth of the loop). The second picks each row's best over its
ranges. A draw under grammar masks reads each masked row's mask words beside its logits in the first
kernel (its MASKED variant), so the masks cost the host no launch of their own.

On a GPU the two logarithms of a draw use the hardware's approximate log2 (MUFU.LG2): libdevice's
exact logf is a dozen FMAs and its special cases, and with it the kernel was bound by instruction
issue at ~100 instructions per vocabulary entry (171 us at [256, 151,936] on an H100, against 26 us
to read the logits). The approximation moves a score by under 2e-5 (most by ~1e-7), so the tokens
are the reference's except at a near-tie that close; the interpreter keeps the exact log.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve_kernels import race_sampling
from nanoserve_kernels.token_bitmask import TokenMasks

# Vocabulary entries per step of a program (four per Philox draw), and programs wanted per SM: at
# [256, 151,936] 2,048 and 4 take 79 us, 2,048 and 8 79, 4,096 and 4 101 (H100; 64 rows 23, 27, 31 us).
BLOCK = 2048
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64
# race_sampling's constants, as compiled kernels can read them
_TWO_TO_MINUS_32 = tl.constexpr(race_sampling.TWO_TO_MINUS_32)
_BELOW_ONE = tl.constexpr(race_sampling.BELOW_ONE)
_SERIES_BELOW = tl.constexpr(race_sampling.SERIES_BELOW)
_THIRD = tl.constexpr(race_sampling.THIRD)
_LN2 = tl.constexpr(0.6931471805599453)
# The GPU's approximate log2 (below); the CPU interpreter has no libdevice, so it takes the exact log.
FAST_LOG: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _log(x):
    if FAST_LOG:
        return libdevice.fast_log2f(x) * _LN2
    else:
        return tl.log(x)


@triton.jit
def _exponential_noise(words):
    v = tl.minimum((words.to(tl.float32) + 0.5) * _TWO_TO_MINUS_32, _BELOW_ONE)
    series = v + v * v * (0.5 + v * (_THIRD + v * 0.25))
    return tl.where(v < _SERIES_BELOW, series, -_log(1.0 - v))


# The mask rows are often the step's sampled slots, a view at any 8-byte offset: one compile for all.
@triton.jit(do_not_specialize=["vocab_size", "blocks_per_split", "mask_words"],
            do_not_specialize_on_alignment=["mask_rows"])
def _race_kernel(logits, stride_row, temperatures, keys, counters, best_scores, best_tokens, vocab_size,
                 blocks_per_split, bitmask, mask_rows, mask_words, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                 MASKED: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperatures + row).to(tl.float32)
    mask_row = tl.load(mask_rows + row).to(tl.int64) if MASKED else -1
    key = tl.load(keys + row)
    counter = tl.load(counters + row)
    zero = tl.zeros([BLOCK // 4], tl.uint32)
    counter_lo = zero + (counter & 0xFFFFFFFF).to(tl.uint32)
    counter_hi = zero + ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = tl.zeros([BLOCK], tl.int32)
    first = split * blocks_per_split
    for block in range(first, first + blocks_per_split):
        entries = block * BLOCK + tl.arange(0, BLOCK)
        scores = tl.load(logits + row.to(tl.int64) * stride_row + entries, mask=entries < vocab_size,
                         other=float("-inf")).to(tl.float32)
        if MASKED:  # the row's grammar mask (token_bitmask.py's layout); a row < 0 keeps every token
            if mask_row >= 0:
                word = tl.load(bitmask + mask_row * mask_words + entries // 32, mask=entries < vocab_size, other=0)
                scores = tl.where(((word >> (entries % 32)) & 1) != 0, scores, float("-inf"))
        if temperature > 0:
            draws = (block * (BLOCK // 4) + tl.arange(0, BLOCK // 4)).to(tl.uint32)
            w0, w1, w2, w3 = tl.philox(key, draws, counter_lo, counter_hi, zero)
            # join stacks on a new last axis: this order lays the words out as entries 4j .. 4j + 3
            words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK])
            scores = scores / temperature - _log(_exponential_noise(words))
        better = scores > best  # strictly: earlier blocks win ties
        best_token = tl.where(better, entries, best_token)
        best = tl.where(better, scores, best)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_token, 2147483647), 0)
    tl.store(best_scores + row * SPLITS + split, top)
    tl.store(best_tokens + row * SPLITS + split, token)


@triton.jit
def _pick_kernel(best_scores, best_tokens, tokens, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS)
    scores = tl.load(best_scores + row * SPLITS + splits)
    winner = tl.argmax(scores, 0, tie_break_left=True)  # lower splits hold lower token ids
    token = tl.sum(tl.where(splits == winner, tl.load(best_tokens + row * SPLITS + splits), 0))
    tl.store(tokens + row, token.to(tl.int64))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a small stand-in, so that test rows still split


def num_splits(rows: int, vocab_size: int, device: torch.device) -> int:
    """Vocabulary ranges per row: enough programs to fill the GPU, from shapes alone."""
    wanted = triton.next_power_of_2(triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(device), rows))
    return min(MAX_SPLITS, wanted, triton.next_power_of_2(triton.cdiv(vocab_size, BLOCK)))


def race_sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                counters: torch.Tensor, masks: TokenMasks | None = None) -> torch.Tensor:
    """nanoserve_kernels.race_sampling.race_sample: one token id (int64) per row of logits [rows, vocab].
    Grammar masks are read inside the race, so a masked draw costs no launch of its own."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    splits = num_splits(rows, vocab_size, logits.device)
    best_scores = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    best_tokens = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    table, mask_rows = masks if masks is not None else (keys, keys)  # unread without masks
    _race_kernel[(rows, splits)](logits, logits.stride(0), temperatures, keys, counters, best_scores, best_tokens,
                                 vocab_size, triton.cdiv(triton.cdiv(vocab_size, BLOCK), splits), table, mask_rows,
                                 table.shape[-1], SPLITS=splits, BLOCK=BLOCK, MASKED=masks is not None)
    _pick_kernel[(rows,)](best_scores, best_tokens, tokens, SPLITS=splits)
    return tokens
