"""The block manager under random admissions, decode appends, preemptions and frees.

The machine keeps its own model of KV memory: whatever a sequence "computes" is written to
the slots its block table names, as (position, token) since real KV depends on both. A wrong
cache hit, or a block handed out while still held, then shows up as a sequence whose slots
no longer hold its tokens at its positions.
"""
from array import array
from collections import Counter

import hypothesis.strategies as st
import xxhash
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.mathutil import cdiv
from scheduler_svc import block_manager as block_manager_module
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import SamplingOptions, Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 16
# Prompts start from a few shared prefixes so that full blocks repeat across sequences.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 7, 8, 5, 6]]


def chain_hashes(token_ids: list[int]) -> list[int]:
    """Written out independently of hash_block: xxh64(uint32 tokens) seeded with the previous hash (0 first)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = array("I", list(token_ids[start:start + BLOCK_SIZE])).tobytes()
        hashes.append(xxhash.xxh64(block, seed=hashes[-1] if hashes else 0).intdigest())
    return hashes


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.kv = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.prefix_by_hash: dict[int, list[int]] = {}
        self.next_seq_id = 0

    def _write_kv(self, seq: Sequence, start: int, end: int) -> None:
        for position in range(start, end):
            slot = (position, seq.token_ids[position])
            self.kv[seq.block_table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = slot

    def _admit(self, seq: Sequence, first_chunk: int) -> bool:
        cached = self.manager.cached_prefix(seq)
        assert len(cached) * BLOCK_SIZE < len(seq), "the last token must always be computed"
        if not self.manager.can_allocate(seq, cached):
            return False
        self.manager.allocate(seq, cached)
        assert len(seq.block_table) == cdiv(len(seq), BLOCK_SIZE)
        # Computed as a prefill split in two chunks, each hashed as it completes blocks.
        start = len(cached) * BLOCK_SIZE
        middle = min(start + first_chunk, len(seq))
        for chunk_start, chunk_end in ((start, middle), (middle, len(seq))):
            self._write_kv(seq, chunk_start, chunk_end)
            self.manager.cache_full_blocks(seq, chunk_start, chunk_end)
        seq.num_computed_tokens = len(seq)
        self.running.append(seq)
        return True

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 4), max_size=9),
          first_chunk=st.integers(1, 8), sampled=st.integers(1, 4))
    def admit(self, prefix, suffix, first_chunk, sampled):
        if not prefix + suffix:
            return
        seq = Sequence(self.next_seq_id, prefix + suffix, SamplingOptions())
        self.next_seq_id += 1
        if self._admit(seq, first_chunk):
            seq.append_token(sampled)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), first_chunk=st.integers(1, 8), sampled=st.integers(1, 4))
    def readmit(self, data, first_chunk, sampled):
        seq = data.draw(st.sampled_from(self.preempted))
        if self._admit(seq, first_chunk):
            self.preempted.remove(seq)
            seq.append_token(sampled)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), sampled=st.integers(1, 4))
    def decode(self, data, sampled):
        seq = data.draw(st.sampled_from(self.running))
        position = seq.num_computed_tokens
        if position == len(seq.block_table) * BLOCK_SIZE and not self.manager.append_block(seq):
            self._preempt(seq)
            return
        self._write_kv(seq, position, position + 1)
        self.manager.cache_full_blocks(seq, position, position + 1)
        seq.num_computed_tokens += 1
        seq.append_token(sampled)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.manager.free(seq)
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.manager.free(seq)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.preempted.append(seq)

    @invariant()
    def every_block_free_or_used(self):
        for block in self.manager.blocks:
            assert block.ref_count >= 0
            assert (block.block_id in self.manager.free_block_ids) != (block.ref_count > 0)

    @invariant()
    def ref_counts_match_holders(self):
        holders = Counter(block_id for seq in self.running for block_id in seq.block_table)
        for seq in self.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
        for seq in self.preempted:
            assert seq.block_table == []
        for block in self.manager.blocks:
            assert block.ref_count == holders[block.block_id]

    @invariant()
    def computed_tokens_are_in_their_slots(self):
        for seq in self.running:
            for position in range(seq.num_computed_tokens):
                slot = self.kv[seq.block_table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                assert slot == (position, seq.token_ids[position])

    @invariant()
    def hash_table_entries_match_content(self):
        for seq in self.running + self.preempted:
            for index, block_hash in enumerate(chain_hashes(seq.token_ids)):
                self.prefix_by_hash[block_hash] = seq.token_ids[:(index + 1) * BLOCK_SIZE]
        for block_hash, block_id in self.manager.hash_to_block_id.items():
            block = self.manager.blocks[block_id]
            assert block.hash == block_hash
            prefix = self.prefix_by_hash[block_hash]
            assert list(prefix[-BLOCK_SIZE:]) == list(block.token_ids)
            assert self.kv[block_id] == list(enumerate(prefix))[-BLOCK_SIZE:]

    def teardown(self):
        for seq in self.running:
            self.manager.free(seq)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_count == 0 for block in self.manager.blocks)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def _seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence(seq_id, token_ids, SamplingOptions())


def _admit_and_compute(manager: BlockManager, seq: Sequence) -> None:
    cached = manager.cached_prefix(seq)
    assert manager.can_allocate(seq, cached)
    manager.allocate(seq, cached)
    manager.cache_full_blocks(seq, len(cached) * BLOCK_SIZE, len(seq))


def test_hash_collision_is_not_a_hit(monkeypatch):
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    monkeypatch.setattr(block_manager_module, "hash_block", lambda prev_hash, token_ids: 42)
    _admit_and_compute(manager, _seq(0, [1, 2, 3, 4, 9]))
    assert manager.cached_prefix(_seq(1, [5, 6, 7, 8, 9])) == []
    assert manager.cached_prefix(_seq(2, [1, 2, 3, 4, 7])) == [manager.blocks[manager.hash_to_block_id[42]]]


def test_a_prompt_that_fits_thanks_to_the_cache_is_admitted():
    manager = BlockManager(5, BLOCK_SIZE)
    first = _seq(0, list(range(1, 14)))  # 4 blocks, 3 of them full
    _admit_and_compute(manager, first)
    second = _seq(1, list(range(1, 13)) + [99])  # 4 blocks too, sharing the 3 full ones
    cached = manager.cached_prefix(second)
    assert [block.block_id for block in cached] == first.block_table[:3]
    assert manager.num_free_blocks == 1 and manager.can_allocate(second, cached)
    manager.allocate(second, cached)
    assert manager.num_free_blocks == 0
    assert [manager.blocks[block_id].ref_count for block_id in first.block_table] == [2, 2, 2, 1]
    third = _seq(2, list(range(1, 9)) + [7, 7])  # 2 blocks cached, no free one for its third
    cached = manager.cached_prefix(third)
    assert len(cached) == 2 and not manager.can_allocate(third, cached)


def test_same_tokens_at_another_position_do_not_hit():
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    _admit_and_compute(manager, _seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert manager.cached_prefix(_seq(1, [5, 6, 7, 8, 0])) == []
