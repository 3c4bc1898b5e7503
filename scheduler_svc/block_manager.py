"""Paged KV memory: a pool of fixed-size blocks shared by reference count, with a prefix cache.

A full block is known by a hash chained over every token before it: xxh64 of the block's own
token ids, seeded with the previous block's hash, so equal hashes mean equal prefixes. Blocks are
hashed only once their KV is computed, so a hit never points at memory still being written.
A freed block keeps its hash on the free list until it is handed out again, so a later
prompt can still revive it.
"""
from array import array
from collections import OrderedDict

import xxhash

from nanoserve.mathutil import cdiv
from nanoserve.wire import token_array
from scheduler_svc.sequence import Sequence


def hash_block(prev_hash: int | None, token_ids: array) -> int:
    """xxh64 of the block's uint32 token ids (nanoserve.wire.token_array), seeded with the previous hash."""
    return xxhash.xxh64_intdigest(token_ids, seed=prev_hash or 0)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None      # set once the block is full and computed
        self.token_ids = token_array()    # its tokens then, compared on a hit to rule out collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first: blocks freed long ago are the least likely to be hit.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """The cached blocks that start the sequence, up to the first miss.

        The block holding the last token is never taken from the cache: that token must be
        computed so that there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        size, tokens = self.block_size, seq.token_ids
        hits: list[Block] = []
        prev_hash = None
        for start in range(0, (len(tokens) - 1) // size * size, size):
            block_tokens = tokens[start:start + size]
            prev_hash = hash_block(prev_hash, block_tokens)
            block_id = self.hash_to_block_id.get(prev_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                break
            hits.append(self.blocks[block_id])
        return hits

    def can_allocate(self, seq: Sequence, cached: list[Block]) -> bool:
        """Whether the free list covers the sequence's blocks; hits on blocks in use cost nothing."""
        num_shared = sum(1 for block in cached if block.ref_count)
        return self.num_blocks_for(len(seq)) - num_shared <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, cached: list[Block]) -> None:
        """Gives an admitted sequence blocks for all its tokens: the cached prefix, then fresh ones."""
        for block in cached:
            if block.ref_count == 0:  # revived from the free list, content intact
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
        num_fresh = self.num_blocks_for(len(seq)) - len(cached)
        fresh = [self._take_free_block() for _ in range(num_fresh)]
        seq.block_table = [block.block_id for block in cached] + fresh

    def append_block(self, seq: Sequence) -> bool:
        """Grows a decoding sequence by one block; False when none is free."""
        if not self.free_block_ids:
            return False
        seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's hold on its blocks. The tail is freed first, so it is reused
        first and the prefix blocks that other prompts may share stay cached longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []

    def cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Hashes the blocks that the tokens computed in [start, end) completed."""
        if not self.enable_prefix_caching:
            return
        size, table = self.block_size, seq.block_table
        for index in range(start // size, end // size):
            prev_hash = self.blocks[table[index - 1]].hash if index else None
            self._cache(self.blocks[table[index]], prev_hash, seq.token_ids[index * size:(index + 1) * size])

    def _cache(self, block: Block, prev_hash: int | None, token_ids: array) -> None:
        """Makes a full, computed block findable by the hash of its prefix."""
        block.token_ids = token_ids
        block.hash = hash_block(prev_hash, token_ids)
        self.hash_to_block_id[block.hash] = block.block_id

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # its cached content is about to be overwritten
            if self.hash_to_block_id.get(block.hash) == block_id:
                self._uncache(block.hash)
            block.hash, block.token_ids = None, token_array()
        block.ref_count = 1
        return block_id

    def _uncache(self, block_hash: int) -> None:
        """The block the hash finds is about to be overwritten: the hash finds nothing any more."""
        del self.hash_to_block_id[block_hash]
