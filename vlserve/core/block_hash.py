"""Chained hashes of full KV blocks for prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys), where the extra keys name every
multimodal item overlapping the block as (mm_hash, offset of the block start inside the item). Equal text
with a different picture therefore never shares KV, while the text blocks before the picture still do.

It lives in core so that a process without an engine (a cache-aware router) computes the very hashes the
engine's prefix cache uses, from a `ProcessedPrompt` alone (`prompt_block_hashes`).
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Sequence

import xxhash

if TYPE_CHECKING:
    from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
    from vlserve.core.request import Request

ROOT = b"vlserve-prefix-root"


def extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> tuple:
    return tuple((it.mm_hash, start - it.offset) for it in items if it.offset < end and it.end > start)


def chain_root(lora_key: str | None) -> bytes:
    """The parent of a prompt's first block: ROOT, or one per LoRA adapter (an adapter changes every KV row)."""
    return ROOT if lora_key is None else xxhash.xxh3_128(ROOT + b"lora:" + lora_key.encode()).digest()


def extend_block_hashes(token_ids: Sequence[int], items: Sequence[MultiModalItem], block_size: int,
                        hashes: list[bytes], keys: list[tuple], root: bytes = ROOT) -> None:
    """Extend `hashes` / `keys` (the chain so far, of the same tokens) to every full block of `token_ids`."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        tokens = tuple(token_ids[start:end])
        extra = extra_keys(items, start, end)
        h = xxhash.xxh3_128()
        h.update(parent)
        h.update(array.array("q", tokens).tobytes())
        if extra:
            h.update(repr(extra).encode())
        keys.append((parent, tokens, extra))
        parent = h.digest()
        hashes.append(parent)


def update_block_hashes(req: Request, block_size: int) -> None:
    """Extend req.block_hashes / req.block_keys to every full block of its known tokens."""
    extend_block_hashes(req.token_ids, req.mm_items, block_size, req.block_hashes, req.block_keys,
                        chain_root(req.lora.key if req.lora else None))


def prompt_block_hashes(prompt: ProcessedPrompt, block_size: int) -> list[bytes]:
    """The prefix-cache hashes of a prompt's full blocks, as the engine computes them for its request."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    hashes: list[bytes] = []
    extend_block_hashes(prompt.prompt_token_ids, prompt.mm_items, block_size, hashes, [],
                        chain_root(prompt.lora.key if prompt.lora else None))
    return hashes
