"""Gives each request the KV blocks its tokens need, shares cached prefix blocks, and takes blocks back."""

from __future__ import annotations

from vlserve.core.request import Request
from vlserve.core.block_hash import update_block_hashes
from vlserve.engine.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Longest run of cached blocks matching the request's leading full blocks (nothing is taken yet).

        At least one token is always left to compute: its logits are needed to sample the next token.
        """
        if not self.enable_prefix_caching:
            return []
        update_block_hashes(req, self.block_size)
        hits = []
        for h, key in zip(req.block_hashes[: (req.num_tokens - 1) // self.block_size], req.block_keys):
            b = self.pool.lookup(h, key)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Room for `num_new_tokens` more computed tokens (after taking `cached` prefix blocks, on admission).

        Returns False, with nothing changed, when the pool is short.
        """
        cached = cached or []
        computed = req.num_computed_tokens + len(cached) * self.block_size
        need = self.blocks_needed(computed + num_new_tokens) - len(req.block_ids) - len(cached)
        idle_cached = sum(1 for b in cached if self.pool.ref_counts[b] == 0)  # taking them shrinks the free queue
        if max(need, 0) + idle_cached > self.pool.num_free:
            return False
        if cached:
            self.pool.touch(cached)
            req.block_ids.extend(cached)
            req.num_computed_tokens = computed
            req.num_cached_blocks = len(cached)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def share_cached_prefix(self, req: Request) -> int:
        """A request that arrived holding its blocks, written elsewhere: its leading full blocks already cached
        here are swapped for the cached ones (same content) and its own copies freed. Returns the tokens shared."""
        hits = self.find_cached_prefix(req)
        block_ids = list(req.block_ids)  # a new list: block ids are only ever appended in place (BlockTables)
        for i, b in enumerate(hits):
            if block_ids[i] != b:
                self.pool.touch([b])
                self.pool.free([block_ids[i]])
                block_ids[i] = b
        req.block_ids = block_ids
        req.num_cached_blocks = len(hits)
        return len(hits) * self.block_size

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that became full and computed this step, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        # computed and known: under async scheduling a step may be computing a token that is not read yet
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        update_block_hashes(req, self.block_size)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i], req.block_keys[i])
        req.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block hash; False (nothing dropped) while a request holds blocks."""
        return self.pool.reset_prefix_cache()

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
