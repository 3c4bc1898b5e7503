"""The worker's memory of its live sequences: a row of the block-table array and sampling
parameters each, updated by the delta entries of each step (worker.proto, StepRequest). A step is
validated whole before any state changes, so a bad request is refused without disturbing the
others.

Each live sequence owns a row ("slot") of `block_tables` and of the sampling columns, kept between
steps, so a step gathers its tables and sampling parameters with one numpy index each instead of
rebuilding them, and of the sampled-token buffer the runner keeps on the device (a decode entry
without tokens reads its token there).
"""
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from nanoserve_model.sampler import seed_key
from nanoserve.mathutil import cdiv
from nanoserve.v1 import worker_pb2
from nanoserve.wire import TOKEN_ID_DTYPE


class SeqState(NamedTuple):  # made once per sequence, when it is reset
    slot: int
    temperature: float
    seed: int | None


class Reset(NamedTuple):
    """A reset entry of a step: what the sampling extras start its slot from."""
    slot: int
    extras: worker_pb2.EntryExtras  # its sampling params and token history
    num_generated: int


@dataclass
class StepWork:
    """A validated step as columns, one row per entry (the packed token order)."""
    slots: np.ndarray           # [n] block-table row of each entry
    num_new: np.ndarray         # [n] tokens each entry computes
    num_computed: np.ndarray    # [n] position of each entry's first new token
    num_blocks: np.ndarray      # [n] blocks in each entry's table
    token_ids: np.ndarray       # packed new tokens; 0 where the sampled token is fed in
    fed_rows: list[int]         # packed positions that take the sequence's last sampled token
    fed_slots: list[int]        # ... from these slots
    sampled: list[int]          # entries that sample, in entry order
    num_generated: list[int]    # ... and the tokens each of their requests has produced so far
    is_decode: bool             # every entry computes exactly one token (decode kernels, CUDA graphs)
    resets: list[Reset] = field(default_factory=list)
    scored: list[tuple[int, list[int]]] = field(default_factory=list)  # (entry, prompt_logprob_targets)

    @property
    def context_lens(self) -> np.ndarray:
        return self.num_computed + self.num_new


class SequenceTable:
    def __init__(self, capacity: int, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int):
        self.num_kv_blocks, self.block_size = num_blocks, block_size
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        # Per slot: the block table, its length, and the position of the token this worker last
        # sampled for the sequence (-1: none), which a decode entry without tokens computes.
        self.block_tables = np.full((capacity, self.max_blocks_per_seq), -1, np.int32)
        self.num_blocks = np.zeros(capacity, np.int64)
        self.sampled_positions = np.full(capacity, -1, np.int64)
        # Per slot, the sampling parameters of its request (nanoserve_model.sampler: a seed as its seed_key).
        self.temperatures = np.zeros(capacity, np.float64)
        self.seeds = np.zeros(capacity, np.int64)
        self.seeded = np.zeros(capacity, bool)
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.states: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, request: worker_pb2.StepRequest) -> StepWork | None:
        """Forgets, then applies every entry; ValueError (and no change at all) on a bad entry.
        None when the step computes nothing. The columns are read whole (each in one call), and
        the checks run on whole columns; only the slot lookup walks the entries."""
        seq_ids, counts = request.seq_ids[:], request.num_token_ids[:]
        _check_columns(request, seq_ids, counts)
        released = set(request.forget_seq_ids)
        # A copy: nothing changes before the step is valid; afterwards it is the new free list.
        spare_slots = self.free_slots + [self.states[seq_id].slot for seq_id in released if seq_id in self.states]
        num_generated = request.num_generated[:]
        reset = {item.entry: self._reset_state(seq_ids[item.entry], item, num_generated[item.entry], released,
                                               spare_slots) for item in request.extras if item.reset}
        slots, get_state = [], self.states.get
        for index, seq_id in enumerate(seq_ids):
            state = reset.get(index) if reset else None
            if state is None:
                state = None if seq_id in released else get_state(seq_id)
                if state is None:
                    raise ValueError(f"sequence {seq_id} is unknown to this worker (forgotten or never "
                                     "seen): its first step must set reset")
            slots.append(state.slot)
        if not seq_ids:
            self._commit(released, spare_slots, {}, [], None)
            return None
        appends = [(item.entry, item.new_block_ids[:]) for item in request.extras if item.new_block_ids]
        scored = [(item.entry, self._checked_targets(seq_ids[item.entry], item, counts[item.entry]))
                  for item in request.extras if item.prompt_logprob_targets]
        # Lists, not arrays, for the per-entry columns: a step of one decode pays no numpy call for them.
        fed = [index for index, count in enumerate(counts) if not count]  # decodes fed their own sampled token
        sampled = [index for index, sample in enumerate(request.sample[:]) if sample]
        tokens = np.frombuffer(request.token_ids, TOKEN_ID_DTYPE)
        token_ids, num_new, fed_rows = _packed_rows(tokens, counts, fed)
        work = StepWork(np.array(slots, np.int64), num_new, np.array(request.num_computed[:], np.int64),
                        np.zeros(len(slots), np.int64), token_ids, fed_rows, [slots[i] for i in fed], sampled,
                        [num_generated[i] for i in sampled], is_decode=len(token_ids) == len(slots),
                        resets=[Reset(reset[item.entry].slot, item, num_generated[item.entry])
                                for item in request.extras if item.reset],
                        scored=scored)
        is_reset = np.zeros(len(slots), bool)
        is_reset[list(reset)] = True
        work.num_blocks = np.where(is_reset, 0, self.num_blocks[work.slots])
        for index, block_ids in appends:
            work.num_blocks[index] += len(block_ids)
        self._check(seq_ids, work, is_reset, appends, fed, tokens, counts)
        self._commit(released, spare_slots, {seq_ids[i]: s for i, s in reset.items()}, appends, work)
        return work

    def _checked_targets(self, seq_id: int, extras: worker_pb2.EntryExtras, num_tokens: int) -> list[int]:
        targets = extras.prompt_logprob_targets[:]
        if len(targets) > num_tokens or max(targets) >= self.vocab_size:
            raise ValueError(f"sequence {seq_id}: {len(targets)} prompt logprob targets for "
                             f"{num_tokens} tokens, or one outside the vocabulary (size {self.vocab_size})")
        return targets

    def _reset_state(self, seq_id: int, extras: worker_pb2.EntryExtras, num_generated: int, released: set[int],
                     spare_slots: list[int]) -> SeqState:
        """A fresh state for a reset entry; its old slot, if any, goes back to the spares."""
        previous = None if seq_id in released else self.states.get(seq_id)
        if previous is not None:
            spare_slots.append(previous.slot)
        if not spare_slots:
            raise ValueError(f"sequence {seq_id}: more live sequences than this worker's "
                             f"{len(self.block_tables)} (max_num_seqs)")
        sampling = extras.sampling
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"sequence {seq_id}: temperature {temperature} is not a finite number >= 0")
        self._check_sampling(seq_id, extras, num_generated)
        return SeqState(spare_slots.pop(), temperature, sampling.seed if sampling.HasField("seed") else None)

    def _check_sampling(self, seq_id: int, extras: worker_pb2.EntryExtras, num_generated: int) -> None:
        """What the logits processors and logprobs would index the vocabulary with (empty fields
        are skipped first: iterating one costs more than asking whether it is empty)."""
        sampling, history, vocab_size = extras.sampling, extras.history_token_ids, self.vocab_size
        for token_ids in (sampling.stop_token_ids, sampling.logit_bias, history):
            if token_ids and max(token_ids) >= vocab_size:
                raise ValueError(f"sequence {seq_id}: token id {max(token_ids)} in its sampling params or "
                                 f"history is outside the vocabulary (size {vocab_size})")
        if history and len(history) < num_generated:
            raise ValueError(f"sequence {seq_id}: its history has {len(history)} tokens, "
                             f"fewer than the {num_generated} it generated")
        if sampling.logprobs > vocab_size or sampling.prompt_logprobs > vocab_size:
            raise ValueError(f"sequence {seq_id}: logprobs or prompt_logprobs exceed the vocabulary")

    def _check(self, seq_ids: list[int], work: StepWork, is_reset: np.ndarray, appends: list[tuple[int, list[int]]],
               fed: list[int], tokens: np.ndarray, counts: list[int]) -> None:
        def fail(index: int, problem: str) -> None:
            raise ValueError(f"sequence {seq_ids[int(index)]}: {problem}")

        if len(set(seq_ids)) < len(seq_ids):
            seen = set()
            for seq_id in seq_ids:
                if seq_id in seen:
                    raise ValueError(f"sequence {seq_id} appears twice in one step")
                seen.add(seq_id)
        for index, block_ids in appends:
            if max(block_ids) >= self.num_kv_blocks:
                fail(index, f"block id {max(block_ids)} is out of range (the KV cache has "
                            f"{self.num_kv_blocks} blocks)")
        if len(tokens) and tokens.max() >= self.vocab_size:
            position = int(np.argmax(tokens >= self.vocab_size))
            fail(np.searchsorted(np.cumsum(counts), position, side="right"),
                 f"token id {tokens[position]} is outside the vocabulary (size {self.vocab_size})")
        if fed:
            fed_entries = np.array(fed)
            expected = np.where(is_reset[fed_entries], -1, self.sampled_positions[work.slots[fed_entries]])
            for index in fed_entries[expected != work.num_computed[fed_entries]]:
                fail(index, f"no tokens to compute, and no token sampled by this worker at position "
                            f"{work.num_computed[index]} to feed in")
        context_lens = work.context_lens
        for index in np.flatnonzero(context_lens > self.max_model_len)[:1]:
            fail(index, f"{context_lens[index]} tokens exceed the model length limit {self.max_model_len}")
        for index in np.flatnonzero(work.num_blocks > self.max_blocks_per_seq)[:1]:
            fail(index, f"{work.num_blocks[index]} blocks exceed the {self.max_blocks_per_seq} a sequence "
                        f"of the model length limit can use")
        needed = cdiv(context_lens, self.block_size)
        for index in np.flatnonzero(needed > work.num_blocks)[:1]:
            fail(index, f"{context_lens[index]} tokens need {needed[index]} blocks, its block table has "
                        f"{work.num_blocks[index]}")

    def _commit(self, released: set[int], spare_slots: list[int], reset: dict[int, SeqState],
                appends: list[tuple[int, list[int]]], work: StepWork | None) -> None:
        for seq_id in released:
            self.states.pop(seq_id, None)
        self.states.update(reset)
        self.free_slots = spare_slots
        for state in reset.values():
            self.temperatures[state.slot] = state.temperature
            self.seeded[state.slot] = state.seed is not None
            self.seeds[state.slot] = seed_key(state.seed or 0)
        if work is None:
            return
        self.block_tables[[state.slot for state in reset.values()]] = -1  # a reused row starts empty
        for index, block_ids in appends:
            end = work.num_blocks[index]
            self.block_tables[work.slots[index], end - len(block_ids):end] = block_ids
        self.num_blocks[work.slots] = work.num_blocks
        positions = np.full(len(work.slots), -1, np.int64)
        positions[work.sampled] = work.context_lens[work.sampled]
        self.sampled_positions[work.slots] = positions


def _check_columns(request: worker_pb2.StepRequest, seq_ids: list[int], counts: list[int]) -> None:
    """The columns describe the same entries, the tokens are as many as they say, and each
    EntryExtras names its own entry, in entry order."""
    lengths = {name: len(getattr(request, name)) for name in ("num_computed", "num_token_ids", "sample", "num_generated")}
    if any(length != len(seq_ids) for length in lengths.values()):
        raise ValueError(f"step {request.step_id}: its columns disagree on the number of entries "
                         f"(seq_ids {len(seq_ids)}, " + ", ".join(f"{k} {v}" for k, v in lengths.items()) + ")")
    if len(request.token_ids) != 4 * sum(counts):
        raise ValueError(f"step {request.step_id}: token_ids holds {len(request.token_ids)} bytes, not the 4 bytes "
                         f"of each of the {sum(counts)} tokens its entries count")
    previous = -1
    for item in request.extras:
        if not previous < item.entry < len(seq_ids):
            raise ValueError(f"step {request.step_id}: the EntryExtras of entry {item.entry} is out of order or "
                             f"out of range (it follows entry {previous}'s; the step has {len(seq_ids)} entries)")
        previous = item.entry


def _packed_rows(tokens: np.ndarray, counts: list[int], fed: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The step's token rows: each entry's tokens in entry order, and a row holding 0 for each entry
    fed its own sampled token (`fed`). Also the rows each entry computes, and the fed rows."""
    if len(fed) == len(counts):  # a pipelined decode step: every entry is fed
        return np.zeros(len(fed), np.int64), np.ones(len(fed), np.int64), list(range(len(fed)))
    num_new = np.array(counts, np.int64)
    if not fed:
        return tokens.astype(np.int64), num_new, []
    num_new[fed] = 1
    fed_rows = (np.cumsum(num_new) - 1)[fed]  # a fed entry's one row
    is_fed_row = np.zeros(len(tokens) + len(fed), bool)
    is_fed_row[fed_rows] = True
    token_ids = np.zeros(len(is_fed_row), np.int64)
    token_ids[~is_fed_row] = tokens
    return token_ids, num_new, fed_rows.tolist()
