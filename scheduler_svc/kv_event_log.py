"""The KV cache events of one engine step, in vLLM's wire shapes, for routers that index which replica
holds which prefix (llm-d's precise prefix scorer, Dynamo's KV router).

An event is what msgspec writes for vLLM's array-like, tagged structs (vllm/distributed/kv_events.py):
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
Hashes are the block manager's own xxh64 chain (see block_manager.hash_block); a consumer that keys
blocks its own way recomputes its keys from the token ids, chained from the parent's. A hash is
stored when the prefix cache starts finding it and removed when it stops (its block is handed out
again), so replaying every event gives the set of hashes the prefix cache can hit. Consecutive
events of one kind that continue each other are merged, as vLLM sends one BlockStored per request.
"""
from array import array

MEDIUM = "GPU"  # where the blocks live, in vLLM's words: the workers' device memory


class KVEventLog:
    """Collects events as the block manager makes them; the engine takes them once per step."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[list] = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: array) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "BlockStored" and last[1][-1] == parent_hash:
            last[1].append(block_hash)   # the next block of the same chain
            last[3].extend(token_ids)
            return
        # A copy (the block's own array is replaced when the block is reused): the publishing thread
        # turns it into a list, off the engine's step.
        self.events.append(["BlockStored", [block_hash], parent_hash, token_ids[:], self.block_size, None, MEDIUM,
                            None])

    def removed(self, block_hash: int) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(block_hash)
            return
        self.events.append(["BlockRemoved", [block_hash], MEDIUM])

    def cleared(self) -> None:
        """Every block is gone (a worker group failed, the pool is rebuilt): what came before is void."""
        self.events = [["AllBlocksCleared"]]

    def take(self) -> list[list]:
        events, self.events = self.events, []
        return events
