"""Next-token sampling by the exponential race, in plain torch: the CPU path, and the oracle for the
Triton kernel (nanoserve_kernels/triton_sampling.py), which draws the same noise (on a GPU through an
approximate logarithm, within 2e-5 of a score) and so picks the same tokens but at such near-ties.

A row at temperature T > 0 takes argmax(logits / T - log E) with E ~ Exp(1) drawn per vocabulary
entry, which draws exactly from softmax(logits / T); a row at T = 0 takes argmax(logits) (greedy).
Ties go to the lowest token id, as torch.argmax. Logit processors (top-k/p, penalties) compose by
changing the logits before the race.

The noise is counter-based, so a row's draw is a function of its (key, counter) pair alone, never of
the batch around it: Philox4x32-10 keyed by the row's 64-bit key, with counter words (j, counter
low half, counter high half, 0), gives the four 32-bit words u of vocabulary entries 4j .. 4j + 3.
Each u becomes V = (u + 1/2) / 2^32 in float32, which the rounding of the largest words would make
1, so V stops at the largest float32 below 1; then E = -log(1 - V), never 0 nor infinite. The race is
decided where E is small, which is where 1 - V loses V's digits in float32, so there E comes from
V directly (its series).
"""
import torch

from nanoserve.mathutil import cdiv
from nanoserve_kernels.token_bitmask import TokenMasks, masked_copy

PHILOX_ROUNDS = 10
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # key increments
WORD = 0xFFFFFFFF
# Below this V, E = V + V^2/2 + V^3/3 + V^4/4 (the rest is under 2e-9 of E); above it, -log(1 - V).
SERIES_BELOW = 2.0 ** -7
THIRD = 0.3333333432674408  # 1/3 rounded to float32, written out so both implementations agree
TWO_TO_MINUS_32 = 2.0 ** -32
BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1
PHILOX_COUNTERS = 1 << 17  # a CPU measure: 16 rows of 152k tokens drew in 50 ms, not 60 at once (1 << 14: 64)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcastable): the four output words.
    Products of two words wrap around 2^64 in int64, which keeps their bit pattern. The rounds work in
    place on copies of the counter words in their common shape: on a CPU, allocating each operation's
    result cost as much as the arithmetic."""
    shape = torch.broadcast_shapes(*(word.shape for word in (*counter, *key)))
    c0, c1, c2, c3 = (word.expand(shape).clone(memory_format=torch.contiguous_format) for word in counter)
    k0, k1 = key
    spare0, spare1 = torch.empty_like(c0), torch.empty_like(c0)
    for _ in range(PHILOX_ROUNDS):
        p0, p1 = c0.mul_(PHILOX_M0), c2.mul_(PHILOX_M1)
        hi0 = torch.bitwise_right_shift(p0, 32, out=spare0).bitwise_and_(WORD)
        hi1 = torch.bitwise_right_shift(p1, 32, out=spare1).bitwise_and_(WORD)
        spare0, spare1 = c1, c3  # free once read below
        c0, c1, c2, c3 = (hi1.bitwise_xor_(c1).bitwise_xor_(k0), p1.bitwise_and_(WORD),
                          hi0.bitwise_xor_(c3).bitwise_xor_(k1), p0.bitwise_and_(WORD))
        k0, k1 = (k0 + PHILOX_W0) & WORD, (k1 + PHILOX_W1) & WORD
    return c0, c1, c2, c3


def exponential_noise(words: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws (float32) from uniform 32-bit words (int64 tensor)."""
    v = words.float().add_(0.5).mul_(TWO_TO_MINUS_32).clamp_(max=BELOW_ONE)
    noise = torch.rsub(v, 1.0).log_().neg_()
    small = v < SERIES_BELOW  # few entries (1 in 128): the series only there
    s = v[small]
    noise[small] = s + s * s * (0.5 + s * (THIRD + s * 0.25))
    return noise


def race_noise(keys: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E [rows, vocab_size] for rows of int64 keys and counters. Philox runs on PHILOX_COUNTERS counters
    at a time (a slice of the vocabulary for every row): its buffers stay in a CPU core's cache."""
    keys, counters = keys[:, None], counters[:, None]
    key, low, high = (keys & WORD, (keys >> 32) & WORD), counters & WORD, (counters >> 32) & WORD
    groups, step = cdiv(vocab_size, 4), max(1, PHILOX_COUNTERS // len(keys))
    parts = []
    for start in range(0, groups, step):
        j = torch.arange(start, min(start + step, groups), dtype=torch.int64, device=keys.device)[None, :]
        parts.append(torch.stack(philox4x32((j, low, high, torch.zeros_like(j)), key), dim=-1))
    words = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return exponential_noise(words.flatten(1)[:, :vocab_size])


def race_sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                counters: torch.Tensor, masks: TokenMasks | None = None) -> torch.Tensor:
    """One token id (int64) per row of logits [rows, vocab]; temperatures [rows] (0: greedy), keys
    and counters [rows] int64; `masks`: grammar masks the race respects (a refused token scores -inf).
    Scores are float32, the temperature applied by division."""
    if masks is not None:
        logits = masked_copy(logits, masks)
    scores = logits.to(torch.float32, copy=True)  # the caller's logits stay as they are
    sampled = temperatures > 0
    if sampled.any():
        rows = sampled.nonzero().squeeze(1)
        noise = race_noise(keys[rows], counters[rows], logits.shape[-1])
        scores[rows] = scores[rows] / temperatures[rows, None].float() - noise.log_()
    return scores.argmax(dim=-1)
