"""The worker's memory of its live sequences: a row of the block-table array and sampling
parameters each, updated by the delta entries of each step (worker.proto, SeqStep). A step is
validated whole before any state changes, so a bad request is refused without disturbing the
others.

Each live sequence owns a row ("slot") of `block_tables`, kept between steps, so a decode step
gathers its tables with one numpy index instead of rebuilding them, and of the sampled-token
buffer the runner keeps on the device (a decode entry without tokens reads its token there).
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from model.sampler import SamplingRow
from nanoserve.v1 import worker_pb2


# NamedTuples, not dataclasses: a decode step builds one per sequence, and tuples are cheap.
class SeqState(NamedTuple):
    slot: int
    num_blocks: int
    temperature: float
    seed: int | None
    sampled_position: int  # where the token this worker last sampled for it goes; -1 if none


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
    sampling: list[SamplingRow] # their parameters

    @property
    def context_lens(self) -> np.ndarray:
        return self.num_computed + self.num_new


class SequenceTable:
    def __init__(self, capacity: int, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_tables = np.full((capacity, self.max_blocks_per_seq), -1, np.int32)
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.states: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, request: worker_pb2.StepRequest) -> StepWork | None:
        """Forgets, then applies every entry; ValueError (and no change at all) on a bad entry.
        None when the step computes nothing."""
        released = set(request.forget_seq_ids)
        # A copy: nothing changes before the step is valid; afterwards it is the new free list.
        spare_slots = self.free_slots + [self.states[seq_id].slot for seq_id in released if seq_id in self.states]
        updated: dict[int, SeqState] = {}
        appends: list[tuple[SeqState, int, list[int]]] = []  # (state, first index, block ids)
        columns = _Columns()
        for entry in request.seqs:
            seq_id = entry.seq_id
            if seq_id in updated:
                raise ValueError(f"sequence {seq_id} appears twice in one step")
            previous = None if seq_id in released else self.states.get(seq_id)
            if entry.reset:
                if previous is not None:
                    spare_slots.append(previous.slot)
                previous = None
            state, first = self._next_state(entry, previous, spare_slots)
            self._check_entry(entry, state)
            if entry.new_block_ids:
                appends.append((state, first, list(entry.new_block_ids)))
            updated[seq_id] = state = state._replace(
                sampled_position=entry.num_computed + max(1, len(entry.token_ids)) if entry.sample else -1)
            columns.add(entry, state)
        # Valid: commit.
        for seq_id in released:
            self.states.pop(seq_id, None)
        self.free_slots = spare_slots
        for state, first, block_ids in appends:
            row = self.block_tables[state.slot]
            if first == 0:
                row[:] = -1
            row[first:first + len(block_ids)] = block_ids
        self.states.update(updated)
        return columns.finish() if request.seqs else None

    def _next_state(self, entry: worker_pb2.SeqStep, previous: SeqState | None,
                    spare_slots: list[int]) -> tuple[SeqState, int]:
        """The entry's state after its new blocks, and the table index they start at."""
        new_blocks = len(entry.new_block_ids)
        if new_blocks and max(entry.new_block_ids) >= self.num_blocks:
            raise ValueError(f"sequence {entry.seq_id}: block id {max(entry.new_block_ids)} is out of range "
                             f"(the KV cache has {self.num_blocks} blocks)")
        if previous is not None:
            return previous._replace(num_blocks=previous.num_blocks + new_blocks), previous.num_blocks
        if not entry.reset:
            raise ValueError(f"sequence {entry.seq_id} is unknown to this worker (forgotten or never "
                             "seen): its first step must set reset")
        if not spare_slots:
            raise ValueError(f"sequence {entry.seq_id}: more live sequences than this worker's "
                             f"{len(self.block_tables)} (max_num_seqs)")
        sampling = entry.sampling
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"sequence {entry.seq_id}: temperature {temperature} is not a finite number >= 0")
        return SeqState(spare_slots.pop(), new_blocks, temperature,
                        sampling.seed if sampling.HasField("seed") else None, -1), 0

    def _check_entry(self, entry: worker_pb2.SeqStep, state: SeqState) -> None:
        seq = f"sequence {entry.seq_id}"
        if entry.token_ids:
            if max(entry.token_ids) >= self.vocab_size:
                raise ValueError(f"{seq}: token id {max(entry.token_ids)} is outside the vocabulary "
                                 f"(size {self.vocab_size})")
        elif entry.reset or entry.num_computed != state.sampled_position:
            raise ValueError(f"{seq}: no tokens to compute, and no token sampled by this worker at "
                             f"position {entry.num_computed} to feed in")
        context_len = entry.num_computed + max(1, len(entry.token_ids))
        if context_len > self.max_model_len:
            raise ValueError(f"{seq}: {context_len} tokens exceed the model length limit {self.max_model_len}")
        if state.num_blocks > self.max_blocks_per_seq:
            raise ValueError(f"{seq}: {state.num_blocks} blocks exceed the {self.max_blocks_per_seq} "
                             f"a sequence of the model length limit can use")
        needed = -(-context_len // self.block_size)
        if needed > state.num_blocks:
            raise ValueError(f"{seq}: {context_len} tokens need {needed} blocks, "
                             f"its block table has {state.num_blocks}")


class _Columns:
    """Accumulates StepWork's columns while entries are validated."""

    def __init__(self):
        self.slots: list[int] = []
        self.num_new: list[int] = []
        self.num_computed: list[int] = []
        self.num_blocks: list[int] = []
        self.token_ids: list[int] = []
        self.fed_rows: list[int] = []
        self.fed_slots: list[int] = []
        self.sampled: list[int] = []
        self.sampling: list[SamplingRow] = []

    def add(self, entry: worker_pb2.SeqStep, state: SeqState) -> None:
        tokens = entry.token_ids
        if tokens:
            self.token_ids.extend(tokens)
        else:
            self.fed_rows.append(len(self.token_ids))
            self.fed_slots.append(state.slot)
            self.token_ids.append(0)
        if entry.sample:
            self.sampled.append(len(self.slots))
            self.sampling.append(SamplingRow(state.temperature, state.seed, entry.num_generated))
        self.slots.append(state.slot)
        self.num_new.append(max(1, len(tokens)))
        self.num_computed.append(entry.num_computed)
        self.num_blocks.append(state.num_blocks)

    def finish(self) -> StepWork:
        def column(values: list[int]) -> np.ndarray:
            return np.array(values, np.int64)

        return StepWork(column(self.slots), column(self.num_new), column(self.num_computed),
                        column(self.num_blocks), self.token_ids, self.fed_rows, self.fed_slots,
                        self.sampled, self.sampling)
