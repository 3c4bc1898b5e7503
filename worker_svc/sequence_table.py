"""The worker's memory of its live sequences: a row of the block-table array and sampling
parameters each, updated by the delta entries of each step (worker.proto, SeqStep). A step is
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


class SeqState(NamedTuple):  # made once per sequence, when it is reset
    slot: int
    temperature: float
    seed: int | None


@dataclass
class StepWork:
    """A validated step as columns, one row per entry (the packed token order)."""
    slots: np.ndarray           # [n] block-table row of each entry
    num_new: np.ndarray         # [n] tokens each entry computes
    num_computed: np.ndarray    # [n] position of each entry's first new token
    num_blocks: np.ndarray      # [n] blocks in each entry's table
    token_ids: list[int]        # packed new tokens; 0 where the sampled token is fed in
    fed_rows: list[int]         # packed positions that take the sequence's last sampled token
    fed_slots: list[int]        # ... from these slots
    sampled: list[int]          # entries that sample, in entry order
    num_generated: list[int]    # ... and the tokens each of their requests has produced so far
    is_decode: bool             # every entry computes exactly one token (decode kernels, CUDA graphs)
    resets: list[tuple[int, worker_pb2.SeqStep]] = field(default_factory=list)  # (slot, entry) of reset entries
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
        None when the step computes nothing. One pass over the entries gathers columns; the
        checks then run on whole columns."""
        released = set(request.forget_seq_ids)
        # A copy: nothing changes before the step is valid; afterwards it is the new free list.
        spare_slots = self.free_slots + [self.states[seq_id].slot for seq_id in released if seq_id in self.states]
        entries = request.seqs
        reset: dict[int, SeqState] = {}  # by entry index
        appends: list[tuple[int, list[int]]] = []  # (entry index, new block ids)
        slots, num_new, num_computed, token_ids = [], [], [], []
        fed_rows, fed_entries, sampled, num_generated, scored = [], [], [], [], []
        for index, entry in enumerate(entries):
            if entry.reset:
                state = reset[index] = self._reset_state(entry, released, spare_slots)
            else:
                state = None if entry.seq_id in released else self.states.get(entry.seq_id)
                if state is None:
                    raise ValueError(f"sequence {entry.seq_id} is unknown to this worker (forgotten or never "
                                     "seen): its first step must set reset")
            if entry.new_block_ids:
                appends.append((index, list(entry.new_block_ids)))
            tokens = entry.token_ids
            if tokens:
                token_ids.extend(tokens[:])  # a slice: upb copies into a list in C, a third faster than iterating
                num_new.append(len(tokens))
                if entry.prompt_logprob_targets:
                    scored.append((index, self._checked_targets(entry)))
            else:
                fed_rows.append(len(token_ids))
                fed_entries.append(index)
                token_ids.append(0)
                num_new.append(1)
            if entry.sample:
                sampled.append(index)
                num_generated.append(entry.num_generated)
            slots.append(state.slot)
            num_computed.append(entry.num_computed)
        if not entries:
            self._commit(released, spare_slots, {}, [], None)
            return None
        work = StepWork(np.array(slots, np.int64), np.array(num_new, np.int64), np.array(num_computed, np.int64),
                        np.zeros(len(slots), np.int64), token_ids, fed_rows, [slots[i] for i in fed_entries],
                        sampled, num_generated, is_decode=len(token_ids) == len(slots),
                        resets=[(state.slot, entries[i]) for i, state in reset.items()], scored=scored)
        is_reset = np.zeros(len(slots), bool)
        is_reset[list(reset)] = True
        work.num_blocks = np.where(is_reset, 0, self.num_blocks[work.slots])
        for index, block_ids in appends:
            work.num_blocks[index] += len(block_ids)
        self._check(entries, work, is_reset, appends, fed_entries)
        self._commit(released, spare_slots, {entries[i].seq_id: s for i, s in reset.items()}, appends, work)
        return work

    def _checked_targets(self, entry: worker_pb2.SeqStep) -> list[int]:
        targets = list(entry.prompt_logprob_targets)
        if len(targets) > len(entry.token_ids) or max(targets) >= self.vocab_size:
            raise ValueError(f"sequence {entry.seq_id}: {len(targets)} prompt logprob targets for "
                             f"{len(entry.token_ids)} tokens, or one outside the vocabulary (size {self.vocab_size})")
        return targets

    def _reset_state(self, entry: worker_pb2.SeqStep, released: set[int], spare_slots: list[int]) -> SeqState:
        """A fresh state for a reset entry; its old slot, if any, goes back to the spares."""
        previous = None if entry.seq_id in released else self.states.get(entry.seq_id)
        if previous is not None:
            spare_slots.append(previous.slot)
        if not spare_slots:
            raise ValueError(f"sequence {entry.seq_id}: more live sequences than this worker's "
                             f"{len(self.block_tables)} (max_num_seqs)")
        sampling = entry.sampling
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"sequence {entry.seq_id}: temperature {temperature} is not a finite number >= 0")
        self._check_sampling(entry)
        return SeqState(spare_slots.pop(), temperature, sampling.seed if sampling.HasField("seed") else None)

    def _check_sampling(self, entry: worker_pb2.SeqStep) -> None:
        """What the logits processors and logprobs would index the vocabulary with (empty fields
        are skipped first: iterating one costs more than asking whether it is empty)."""
        sampling, history, vocab_size = entry.sampling, entry.history_token_ids, self.vocab_size
        for token_ids in (sampling.stop_token_ids, sampling.logit_bias, history):
            if token_ids and max(token_ids) >= vocab_size:
                raise ValueError(f"sequence {entry.seq_id}: token id {max(token_ids)} in its sampling params or "
                                 f"history is outside the vocabulary (size {vocab_size})")
        if history and len(history) < entry.num_generated:
            raise ValueError(f"sequence {entry.seq_id}: its history has {len(history)} tokens, "
                             f"fewer than the {entry.num_generated} it generated")
        if sampling.logprobs > vocab_size or sampling.prompt_logprobs > vocab_size:
            raise ValueError(f"sequence {entry.seq_id}: logprobs or prompt_logprobs exceed the vocabulary")

    def _check(self, entries, work: StepWork, is_reset: np.ndarray, appends: list[tuple[int, list[int]]],
               fed_entries: list[int]) -> None:
        def fail(index: int, problem: str) -> None:
            raise ValueError(f"sequence {entries[int(index)].seq_id}: {problem}")

        if len({entry.seq_id for entry in entries}) < len(entries):
            seen = set()
            for entry in entries:
                if entry.seq_id in seen:
                    raise ValueError(f"sequence {entry.seq_id} appears twice in one step")
                seen.add(entry.seq_id)
        for index, block_ids in appends:
            if max(block_ids) >= self.num_kv_blocks:
                fail(index, f"block id {max(block_ids)} is out of range (the KV cache has "
                            f"{self.num_kv_blocks} blocks)")
        if max(work.token_ids) >= self.vocab_size:
            row = next(i for i, t in enumerate(work.token_ids) if t >= self.vocab_size)
            fail(np.searchsorted(np.cumsum(work.num_new), row, side="right"),
                 f"token id {work.token_ids[row]} is outside the vocabulary (size {self.vocab_size})")
        if fed_entries:
            fed = np.array(fed_entries)
            expected = np.where(is_reset[fed], -1, self.sampled_positions[work.slots[fed]])
            for index in fed[expected != work.num_computed[fed]]:
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
