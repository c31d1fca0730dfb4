"""Fixed-size block pool for shipping per-token encoder outputs between processes.

In encode/language disaggregation the vision-encoder process produces, for each
prompt token, an embedding row, the token id to fill in, and 3 M-RoPE position
ids, plus a few per-request integers.  Both sides keep a pool of equally sized
blocks so a request of L tokens occupies ceil(L / block_tokens) blocks that need
not be contiguous.  Everything here runs on one asyncio thread, so no locks.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BufferSpec:
    block_tokens: int  # tokens per block
    hidden: int  # embedding width
    dtype: torch.dtype  # embedding dtype
    extra_features: int = 0  # extra per-token columns after the embedding (e.g. deepstack)
    aux_fields: int = 4  # per-request int64 values, kept in the request's first block

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {self.block_tokens}")
        if self.hidden <= 0:
            raise ValueError(f"hidden must be > 0, got {self.hidden}")
        if self.extra_features < 0:
            raise ValueError(f"extra_features must be >= 0, got {self.extra_features}")
        if self.aux_fields < 0:
            raise ValueError(f"aux_fields must be >= 0, got {self.aux_fields}")
        if self.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"dtype must be one of {_ALLOWED_DTYPES}, got {self.dtype}")

    @property
    def width(self) -> int:
        """Columns per embedding row: hidden plus the extra features."""
        return self.hidden + self.extra_features


class EmbeddingBuffers:
    """A preallocated pool of blocks with all-or-nothing allocation."""

    def __init__(self, spec: BufferSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.spec = spec
        self.device = torch.device(device)
        bt = spec.block_tokens
        self.embeddings = torch.zeros(num_blocks, bt, spec.width, dtype=spec.dtype, device=self.device)
        self.fill_ids = torch.zeros(num_blocks, bt, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(num_blocks, 3, bt, dtype=torch.int64, device=self.device)
        self.aux = torch.zeros(num_blocks, spec.aux_fields, dtype=torch.int64, device=self.device)
        self._num_blocks = num_blocks
        # FIFO reuse spreads wear over the pool and makes stale-id bugs show up sooner.
        self._free: deque[int] = deque(range(num_blocks))
        self.allocated: set[int] = set()

    # ---- accounting -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.allocated)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for num_tokens tokens (at least one, so aux always has a home)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return max(1, -(-num_tokens // self.spec.block_tokens))

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Block ids for num_tokens tokens, or None if the pool is too full right now."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
        need = self.blocks_for(num_tokens)
        if need > self._num_blocks:
            # Would never fit, even with an empty pool: fail loudly instead of letting the caller wait.
            raise ValueError(
                f"{num_tokens} tokens need {need} blocks but the pool only has {self._num_blocks} "
                f"(block_tokens={self.spec.block_tokens})"
            )
        if need > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(need)]
        self.allocated.update(ids)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks to the pool; validates every id before touching any state."""
        ids = [self._as_id(b) for b in block_ids]
        seen: set[int] = set()
        for b in ids:
            if b in seen:
                raise ValueError(f"block id {b} appears twice in one free() call")
            seen.add(b)
            if b not in self.allocated:
                raise ValueError(f"block id {b} is not allocated (double free?)")
        self.allocated.difference_update(ids)
        self._free.extend(ids)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless free and allocated blocks partition the pool exactly."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("free list contains duplicate block ids")
        overlap = free_set & self.allocated
        if overlap:
            raise RuntimeError(f"blocks both free and allocated: {sorted(overlap)[:10]}")
        if free_set | self.allocated != set(range(self._num_blocks)):
            raise RuntimeError("free and allocated blocks do not cover exactly the pool")

    # ---- data movement ----------------------------------------------------

    def scatter(self, block_ids: Sequence[int], start: int, embeddings: Tensor, fill_ids: Tensor,
                positions: Tensor) -> None:
        """Write n rows at token offsets start..start+n of the sequence laid over block_ids."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.spec.width:
            raise ValueError(f"embeddings must be [n, {self.spec.width}], got {tuple(embeddings.shape)}")
        n = embeddings.shape[0]
        if tuple(fill_ids.shape) != (n,):
            raise ValueError(f"fill_ids must be [{n}], got {tuple(fill_ids.shape)}")
        if tuple(positions.shape) != (3, n):
            raise ValueError(f"positions must be [3, {n}], got {tuple(positions.shape)}")
        blk, off = self._locate(block_ids, start, n)
        if n == 0:
            return
        bt = self.spec.block_tokens
        rows = blk * bt + off
        flat_emb = self.embeddings.view(self._num_blocks * bt, self.spec.width)
        flat_emb.index_copy_(0, rows, embeddings.to(device=self.device, dtype=self.spec.dtype))
        self.fill_ids.view(-1).index_copy_(0, rows, fill_ids.to(device=self.device, dtype=torch.int64))
        # positions keep the 3 axis between block and row, so index (block, :, row) directly.
        self.positions[blk, :, off] = positions.to(device=self.device, dtype=torch.int64).T

    def gather(self, block_ids: Sequence[int], start: int, num_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """Copies of rows start..start+num_tokens: embeddings [n, W], fill_ids [n], positions [3, n]."""
        blk, off = self._locate(block_ids, start, num_tokens)
        bt = self.spec.block_tokens
        rows = blk * bt + off
        emb = self.embeddings.view(self._num_blocks * bt, self.spec.width).index_select(0, rows)
        ids = self.fill_ids.view(-1).index_select(0, rows)
        pos = self.positions[blk, :, off].T.contiguous()
        return emb, ids, pos

    def write_aux(self, block_ids: Sequence[int], values: Sequence[int]) -> None:
        """Store the per-request integers in the request's first block."""
        first = self._first_block(block_ids)
        if len(values) != self.spec.aux_fields:
            raise ValueError(f"expected {self.spec.aux_fields} aux values, got {len(values)}")
        self.aux[first] = torch.tensor([operator.index(v) for v in values], dtype=torch.int64)

    def read_aux(self, block_ids: Sequence[int]) -> list[int]:
        return [int(v) for v in self.aux[self._first_block(block_ids)].tolist()]

    # ---- helpers ----------------------------------------------------------

    def _as_id(self, b: int) -> int:
        try:
            b = operator.index(b)
        except TypeError:
            raise ValueError(f"block id must be an integer, got {b!r}") from None
        if not 0 <= b < self._num_blocks:
            raise ValueError(f"unknown block id {b} (pool has {self._num_blocks} blocks)")
        return b

    def _check_ids(self, block_ids: Sequence[int]) -> list[int]:
        # Reject stale or aliased ids: writing into a freed or repeated block corrupts another request.
        ids = [self._as_id(b) for b in block_ids]
        if not ids:
            raise ValueError("block_ids is empty")
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids contains duplicates")
        for b in ids:
            if b not in self.allocated:
                raise ValueError(f"block id {b} is not allocated")
        return ids

    def _first_block(self, block_ids: Sequence[int]) -> int:
        return self._check_ids(block_ids)[0]

    def _locate(self, block_ids: Sequence[int], start: int, n: int) -> tuple[Tensor, Tensor]:
        """(block index, row offset) tensors for tokens start..start+n, computed once per call."""
        ids = self._check_ids(block_ids)
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
        bt = self.spec.block_tokens
        capacity = len(ids) * bt
        if start + n > capacity:
            raise ValueError(
                f"tokens {start}..{start + n} run past the {capacity} tokens held by {len(ids)} blocks"
            )
        tok = torch.arange(start, start + n, device=self.device)
        table = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return table[tok // bt], tok % bt
