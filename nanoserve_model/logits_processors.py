"""What a request asks of sampling beyond its temperature, applied to a batch of logits at once.

vLLM's controls with vLLM's semantics and order: min_tokens (its stop tokens banned) and
logit_bias, then the repetition, presence and frequency penalties, then, on the distribution at
the row's temperature, min_p, top_k and top_p. The sampler then draws from the processed logits
(removed tokens are -inf) at the row's temperature. Greedy rows (temperature 0) go through the
same passes: min_p, top_k and top_p never remove the most likely token, so their argmax is theirs.

The functions below are pure and batched (one row per sampled sequence, no Python loop over rows).
LogitsProcessors keeps each slot's parameters and the state the penalties need, and runs only the
passes some row of the batch asks for: a batch that asks for none is not touched.
"""
from typing import NamedTuple

import numpy as np
import torch

NEG_INF = float("-inf")


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits[rows[i], token_ids[i, :]] = -inf, in place (a row's ids may repeat)."""
    logits[rows[:, None], token_ids] = NEG_INF


def add_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> None:
    """logits[i, token_ids[i, j]] += bias[i, j], in place; padding entries carry a bias of 0."""
    logits.scatter_add_(1, token_ids, bias)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. Tokens seen in the prompt or the output so far have positive logits
    divided by `repetition`, negative ones multiplied by it; each token in the output loses
    `presence` once and `frequency` per occurrence. output_counts [rows, vocab] counts each
    token's occurrences in the output, in_prompt [rows, vocab] marks the prompt's tokens."""
    in_output = output_counts > 0
    repetition = repetition[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_output | in_prompt, repeated, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def _scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T per row; greedy rows (T = 0) keep theirs (their masks only need the argmax kept)."""
    return logits / torch.where(temperature > 0, temperature, 1.0)[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Removes tokens whose probability at the row's temperature is below min_p times the most
    likely token's (min_p 0 removes none)."""
    probs = _scaled(logits, temperature).softmax(dim=-1)
    too_unlikely = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(too_unlikely, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keeps each row's top_k largest logits (ties with the k-th included); top_k 0 keeps all.
    `max_top_k` is the largest top_k of the batch, known on the host."""
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(1, max_top_k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def _top_p_removal(ascending_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """On probabilities sorted ascending: the tokens whose cumulative probability, from the least
    likely up, stays within 1 - top_p (as transformers' and vLLM's top-p); the likeliest always stays."""
    removed = ascending_probs.cumsum(dim=-1) <= (1 - top_p)[:, None]
    removed[:, -1] = False
    return removed


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      temperature: torch.Tensor) -> torch.Tensor:
    """top_k (0 = off) then top_p (1 = off) over whole sorted rows: the general case."""
    scaled, order = _scaled(logits, temperature).sort(dim=-1)
    vocab = logits.shape[-1]
    kth_from_top = (vocab - top_k.clamp(1, vocab))[:, None]
    kth = scaled.gather(1, kth_from_top)
    scaled = scaled.masked_fill((scaled < kth) & (top_k[:, None] > 0), NEG_INF)
    removed = _top_p_removal(scaled.softmax(dim=-1), top_p) | torch.isneginf(scaled)
    return logits.masked_fill(removed.scatter(1, order, removed), NEG_INF)


def apply_top_p_within_top_k(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             temperature: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """top_k then top_p for rows that all have a top_k (> 0): only the `max_top_k` largest logits
    of a row can survive, so top-p sorts those instead of the whole vocabulary. Same masks as
    apply_top_k_top_p."""
    values, token_ids = logits.topk(max_top_k, dim=-1)  # descending
    beyond_k = torch.arange(max_top_k, device=logits.device)[None, :] >= top_k[:, None]
    values = values.masked_fill(beyond_k, NEG_INF)
    ascending = _scaled(values, temperature).flip(-1)
    removed = _top_p_removal(ascending.softmax(dim=-1), top_p).flip(-1)
    kept = values.masked_fill(removed, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter_(1, token_ids, kept)


class ProcessorParams(NamedTuple):
    """One sequence's controls, defaults meaning off (as in llm.proto's SamplingParams)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    banned_until_min_tokens: tuple[int, ...] = ()    # eos (unless ignored) and the stop token ids
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# One bit per pass, in a uint8 per slot.
BAN, BIAS, PENALTIES, MIN_P, TOP_K, TOP_P = (1 << i for i in range(6))
# Columns of the per-slot float parameters, gathered and uploaded for a batch in one copy.
_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k")
_DEFAULT_ROW = np.array([getattr(ProcessorParams(), name) for name in _COLUMNS], np.float32)


def _flags(params: ProcessorParams) -> int:
    return ((BAN if params.min_tokens and params.banned_until_min_tokens else 0)
            | (BIAS if params.logit_bias else 0) | (PENALTIES if params.has_penalties else 0)
            | (MIN_P if params.min_p > 0 else 0) | (TOP_K if params.top_k > 0 else 0)
            | (TOP_P if params.top_p < 1 else 0))


class LogitsProcessors:
    """Per-slot controls and the state behind them, on the sampling rank.

    Host (numpy, per slot): which passes the slot needs, its parameters, its ban and bias lists
    (rows padded to the widest), and its count of generated tokens (for min_tokens). A batch's
    rows of them are gathered with one numpy index and uploaded together. Device: for the
    penalties, each slot's output token counts [capacity, vocab] and prompt tokens (a mask),
    allocated the first time a sequence asks for a penalty (~0.8 GB per 1,000 slots at a
    150k vocabulary), reset from the sequence's history when it is, and counted up with the
    sampled tokens after every step that samples a slot using them (observe)."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.flags = np.zeros(capacity, np.uint8)
        # A slot without flags holds the defaults (clear()): a batch that other rows flag passes
        # it through every pass unchanged.
        self.params = np.tile(_DEFAULT_ROW, (capacity, 1))
        self.min_tokens = np.zeros(capacity, np.int64)
        self.num_generated = np.zeros(capacity, np.int64)
        self.banned = np.zeros((capacity, 1), np.int64)
        self.bias_ids = np.zeros((capacity, 1), np.int64)
        self.bias = np.zeros((capacity, 1), np.float32)
        self.output_counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.num_flagged = 0  # slots with any flag: while 0, no batch is even looked at
        self._device_table: torch.Tensor | None = None  # self.params on the device; None: changed since

    def reset(self, slot: int, params: ProcessorParams, history: list[int], num_generated: int) -> None:
        """A new sequence in `slot`; `history` is its prompt then its `num_generated` tokens so far
        (needed only with penalties)."""
        flags = _flags(params)
        self.num_flagged += bool(flags) - bool(self.flags[slot])
        self.flags[slot] = flags
        self.params[slot] = [getattr(params, name) for name in _COLUMNS]
        self._device_table = None
        # Without tokens to ban, min_tokens asks for nothing (a BAN batch must not ban its padding).
        self.min_tokens[slot] = params.min_tokens if flags & BAN else 0
        self.num_generated[slot] = num_generated
        self.banned = _set_row(self.banned, slot, params.banned_until_min_tokens)
        self.bias_ids = _set_row(self.bias_ids, slot, [token_id for token_id, _ in params.logit_bias])
        self.bias = _set_row(self.bias, slot, [bias for _, bias in params.logit_bias], pad=0.0)
        if flags & PENALTIES:
            self._reset_counts(slot, history, num_generated)

    def clear(self, slot: int) -> None:
        """A new sequence in `slot` that asks for no pass: only a slot that held one has work."""
        if self.flags[slot]:
            self.num_flagged -= 1
            self.flags[slot] = 0
            self.params[slot] = _DEFAULT_ROW
            self._device_table = None
            self.min_tokens[slot] = 0
            self.bias[slot] = 0.0

    def _reset_counts(self, slot: int, history: list[int], num_generated: int) -> None:
        if self.output_counts is None:
            shape = (len(self.flags), self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        tokens = torch.tensor(history, dtype=torch.int64).to(self.device)
        num_prompt = max(0, len(history) - num_generated)
        self.in_prompt[slot].zero_().index_fill_(0, tokens[:num_prompt], True)
        self.output_counts[slot].zero_().index_add_(0, tokens[num_prompt:],
                                                   torch.ones_like(tokens[num_prompt:], dtype=torch.int32))

    def batch_flags(self, slots: np.ndarray) -> int:
        """The passes a batch of slots needs (0: none, and nothing to do)."""
        return int(np.bitwise_or.reduce(self.flags[slots])) if self.num_flagged else 0

    def __call__(self, logits: torch.Tensor, slots: np.ndarray, device_slots: torch.Tensor,
                 flags: int) -> torch.Tensor:
        """The processed logits of the batch whose rows sample for `slots` (host) / `device_slots`
        (the same, on the device); `logits` stays as it is. A float32 copy when a pass adds to the
        logits (ban, bias, penalties); min_p, top_k and top_p only remove tokens, so alone they
        keep the logits' dtype and copy no [batch, vocab] float32 tensor."""
        out = logits.to(torch.float32, copy=True) if flags & (BAN | BIAS | PENALTIES) else logits
        params = self.params[slots]
        columns = dict(zip(_COLUMNS, self._device_params()[device_slots].unbind(dim=1)))
        if flags & BAN:
            rows = np.flatnonzero(self.num_generated[slots] < self.min_tokens[slots])
            if rows.size:
                ban_tokens(out, self._upload(rows), self._upload(self.banned[slots[rows]]))
        if flags & BIAS:
            add_logit_bias(out, self._upload(self.bias_ids[slots]), self._upload(self.bias[slots]))
        if flags & PENALTIES:
            out = apply_penalties(out, self.output_counts[device_slots], self.in_prompt[device_slots],
                                  columns["repetition_penalty"], columns["presence_penalty"],
                                  columns["frequency_penalty"])
        temperature = columns["temperature"]
        if flags & MIN_P:
            out = apply_min_p(out, columns["min_p"], temperature)
        if flags & (TOP_K | TOP_P):
            out = self._top_k_top_p(out, params, columns)
        return out

    def _top_k_top_p(self, logits: torch.Tensor, params: np.ndarray, columns: dict) -> torch.Tensor:
        """top-k by a threshold; top-p sorts only the rows that ask for it, and of those only their
        top-k logits when every one of them has a top-k."""
        top_k, top_p, temperature = columns["top_k"].to(torch.int64), columns["top_p"], columns["temperature"]
        host_k = params[:, _COLUMNS.index("top_k")].astype(np.int64)
        rows = np.flatnonzero(params[:, _COLUMNS.index("top_p")] < 1)
        if rows.size < len(params) and host_k.any():
            logits = apply_top_k(logits, top_k, int(host_k.max()))
        if not rows.size:
            return logits
        if rows.size < len(params):
            index = self._upload(rows)
            top_k, top_p, temperature = top_k[index], top_p[index], temperature[index]
            # Out of place: `logits` may be the caller's own.
            return logits.index_put((index,), self._top_p(logits[index], top_k, top_p, temperature, host_k[rows]))
        return self._top_p(logits, top_k, top_p, temperature, host_k)

    @staticmethod
    def _top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, temperature: torch.Tensor,
               host_k: np.ndarray) -> torch.Tensor:
        if host_k.all():
            return apply_top_p_within_top_k(logits, top_k, top_p, temperature, int(host_k.max()))
        return apply_top_k_top_p(logits, top_k, top_p, temperature)

    def observe(self, tokens: torch.Tensor, slots: np.ndarray, device_slots: torch.Tensor, flags: int) -> None:
        """Counts the tokens just sampled for the batch's slots (after a pass with `flags`)."""
        self.num_generated[slots] += 1
        if flags & PENALTIES:
            self.output_counts.index_put_((device_slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                          accumulate=True)

    def _device_params(self) -> torch.Tensor:
        """self.params on the device, uploaded again only after a slot's parameters changed: a
        step gathers its rows there instead of uploading them."""
        if self._device_table is None:
            self._device_table = self._upload(self.params)
        return self._device_table

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return upload(array, self.device)


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, the copy queued behind the work before it."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":  # pinned, so the copy does not wait for the work queued before it
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _set_row(table: np.ndarray, slot: int, values: list, pad=None) -> np.ndarray:
    """table with row `slot` set to `values`, padded with its first value (or `pad`); the table
    widens when the values do not fit."""
    if len(values) > table.shape[1]:
        table = np.pad(table, ((0, 0), (0, len(values) - table.shape[1])))
    fill = pad if pad is not None else (values[0] if values else 0)
    table[slot] = fill
    table[slot, :len(values)] = values
    return table
