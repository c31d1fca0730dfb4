"""Fixed-size KV blocks: reference counts, a free queue that doubles as the prefix cache's LRU, and the
hash -> block map of cached full blocks.

A freed block keeps its hash (and contents) until it is handed out again, so a later request with the same
prefix can take it back; the least recently freed block is reused first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlserve.engine.kv_events import KVEventRecorder

BlockKey = tuple  # (parent hash, token ids, extra keys): the exact content a block hash stands for


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._cached: dict[bytes, int] = {}
        self.events: KVEventRecorder | None = None  # set when the engine publishes KV cache events

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool exhausted: wanted {n}, {len(self._free)} free")  # callers check first
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Share cached blocks with one more request (taking them off the free queue if idle)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        # In reverse: the tail of a sequence is the least likely to be shared, so it is reused first.
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    # ---- prefix cache -----------------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        b = self._cached.get(block_hash)
        if b is None or self._key_of[b] != key:  # content check: a hash collision never aliases a block
            return None
        return b

    def cache(self, block: int, block_hash: bytes, key: BlockKey) -> None:
        if block_hash in self._cached or block in self._hash_of:
            return  # same content already cached by another request (or this block already is)
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        self._key_of[block] = key
        if self.events is not None:
            self.events.stored(block_hash, key[0])

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use, as its request may still
        register or share it."""
        if self.num_free != self.num_blocks:
            return False
        self._cached.clear()
        self._hash_of.clear()
        self._key_of.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, b: int) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._cached[h]
            del self._key_of[b]
            if self.events is not None:
                self.events.removed(h)

    def check_integrity(self) -> None:
        """Free exactly when unreferenced; the hash map and the per-block hashes agree."""
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref count {self.ref_counts[b]} disagrees with the free queue")
            if self.ref_counts[b] < 0:
                raise AssertionError(f"block {b}: negative ref count")
        for h, b in self._cached.items():
            if self._hash_of.get(b) != h:
                raise AssertionError(f"block {b}: cached under a hash it does not carry")
        if len(self._hash_of) != len(self._cached):
            raise AssertionError("prefix cache: block hashes and hash map differ in size")
