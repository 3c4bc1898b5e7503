"""A block manager that reports its prefix cache's changes as KV events (kv_event_log.py).

Used only when KV events are on, so the plain BlockManager's hot path stays as it is.
"""
from array import array

from scheduler_svc.block_manager import Block, BlockManager
from scheduler_svc.kv_event_log import KVEventLog


class PublishingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, log: KVEventLog):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.log = log

    def _cache(self, block: Block, prev_hash: int | None, token_ids: array) -> None:
        known = len(self.hash_to_block_id)
        super()._cache(block, prev_hash, token_ids)
        if len(self.hash_to_block_id) > known:  # a hash the cache did not find before (not a second copy)
            self.log.stored(block.hash, prev_hash, token_ids)

    def _uncache(self, block_hash: int) -> None:
        super()._uncache(block_hash)
        self.log.removed(block_hash)
