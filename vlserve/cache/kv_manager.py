"""Gives each request the KV blocks its computed tokens need and takes them back when it stops."""

from __future__ import annotations

from vlserve.cache.block_pool import BlockPool
from vlserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and nothing changed) if the pool is short."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
