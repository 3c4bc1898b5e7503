"""The worker's memory of its live sequences: block table and sampling parameters, updated by the
delta entries of each step (worker.proto, SeqStep). A step is validated whole before any state
changes, so a bad request is refused without disturbing the others."""
import math
from typing import NamedTuple

from model.sampler import SamplingRow
from nanoserve.v1 import worker_pb2


# NamedTuples, not dataclasses: a decode step builds one of each per sequence, and tuples are cheap.
class SeqState(NamedTuple):
    block_table: tuple[int, ...]
    temperature: float
    seed: int | None


class SeqWork(NamedTuple):
    """One sequence's part of a validated step."""
    token_ids: list[int]
    num_computed: int               # position of token_ids[0]
    block_table: tuple[int, ...]
    sampling: SamplingRow | None    # set when a token is sampled after this step

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


class SequenceTable:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.states: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, request: worker_pb2.StepRequest) -> list[SeqWork]:
        """Forgets, then applies every entry; ValueError (and no change at all) on a bad entry."""
        forgotten = set(request.forget_seq_ids)
        updated: dict[int, SeqState] = {}
        work = []
        for entry in request.seqs:
            if entry.seq_id in updated:
                raise ValueError(f"sequence {entry.seq_id} appears twice in one step")
            previous = None if entry.reset or entry.seq_id in forgotten else self.states.get(entry.seq_id)
            updated[entry.seq_id] = state = self._next_state(entry, previous)
            work.append(self._work(entry, state))
        for seq_id in forgotten:
            self.states.pop(seq_id, None)
        self.states.update(updated)
        return work

    def _next_state(self, entry: worker_pb2.SeqStep, previous: SeqState | None) -> SeqState:
        for block_id in entry.new_block_ids:
            if block_id >= self.num_blocks:
                raise ValueError(f"sequence {entry.seq_id}: block id {block_id} is out of range "
                                 f"(the KV cache has {self.num_blocks} blocks)")
        if previous is not None:
            return SeqState(previous.block_table + tuple(entry.new_block_ids), previous.temperature, previous.seed)
        if not entry.reset:
            raise ValueError(f"sequence {entry.seq_id} is unknown to this worker (forgotten or never "
                             "seen): its first step must set reset")
        sampling = entry.sampling
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"sequence {entry.seq_id}: temperature {temperature} is not a finite number >= 0")
        return SeqState(tuple(entry.new_block_ids), temperature,
                        sampling.seed if sampling.HasField("seed") else None)

    def _work(self, entry: worker_pb2.SeqStep, state: SeqState) -> SeqWork:
        seq = f"sequence {entry.seq_id}"
        if not entry.token_ids:
            raise ValueError(f"{seq}: no tokens to compute")
        if max(entry.token_ids) >= self.vocab_size:
            raise ValueError(f"{seq}: token id {max(entry.token_ids)} is outside the vocabulary "
                             f"(size {self.vocab_size})")
        work = SeqWork(list(entry.token_ids), entry.num_computed, state.block_table,
                       SamplingRow(state.temperature, state.seed, entry.num_generated) if entry.sample else None)
        if work.context_len > self.max_model_len:
            raise ValueError(f"{seq}: {work.context_len} tokens exceed the model length limit {self.max_model_len}")
        needed = -(-work.context_len // self.block_size)
        if needed > len(state.block_table):
            raise ValueError(f"{seq}: {work.context_len} tokens need {needed} blocks, "
                             f"its block table has {len(state.block_table)}")
        return work
