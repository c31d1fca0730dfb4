"""Chained hashes of full KV blocks for prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys), where the extra keys name every
multimodal item overlapping the block as (mm_hash, offset of the block start inside the item). Equal text
with a different picture therefore never shares KV, while the text blocks before the picture still do.
"""

from __future__ import annotations

import array

import xxhash

from vlserve.core.request import Request

ROOT = b"vlserve-prefix-root"


def extra_keys(req: Request, start: int, end: int) -> tuple:
    return tuple((it.mm_hash, start - it.offset) for it in req.mm_items if it.offset < end and it.end > start)


def update_block_hashes(req: Request, block_size: int) -> None:
    """Extend req.block_hashes / req.block_keys to every full block of its known tokens."""
    hashes, keys = req.block_hashes, req.block_keys
    parent = hashes[-1] if hashes else ROOT
    for i in range(len(hashes), req.num_tokens // block_size):
        start, end = i * block_size, (i + 1) * block_size
        tokens = tuple(req.token_ids[start:end])
        extra = extra_keys(req, start, end)
        h = xxhash.xxh3_128()
        h.update(parent)
        h.update(array.array("q", tokens).tobytes())
        if extra:
            h.update(repr(extra).encode())
        parent = h.digest()
        hashes.append(parent)
        keys.append((hashes[-2] if len(hashes) > 1 else ROOT, tokens, extra))
