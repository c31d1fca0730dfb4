"""Fixed-size KV blocks: a free list plus reference counts, with a self-check for tests."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool exhausted: wanted {n}, {len(self._free)} free")  # callers check first
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Released in reverse so the tail of a sequence (least likely to be shared later) is reused first.
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Every block is either free (ref 0, listed once) or in use (ref > 0, not listed)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {self.ref_counts[b]} disagrees with the free list")
