"""KV cache events: what an engine's prefix cache gained and lost, published for cache-aware routers.

An engine with `--kv-events-endpoint` publishes one `KVEventBatch` per engine step that changed its prefix cache
(and an empty one now and then as a keepalive) as one msgpack frame on a ZeroMQ PUB socket. Block hashes are the
engine's (`core/block_hash.py`): a subscriber matches them against `prompt_block_hashes` of a request.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Full blocks whose hashes entered the prefix cache, a chain in order: block i's parent is block i-1, the
    first one's `parent_hash` (None: the first block of a prompt). Each block holds `block_size` tokens."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Hashes that left the prefix cache (their blocks were reused for other tokens)."""

    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", frozen=True):
    """`replica_id`: the publisher of this run (a restart is a new id, its `seq` starting at 0 again); `seq`: one
    more than the previous batch's, so a subscriber sees a lost batch; `ts`: the publisher's wall clock (seconds,
    for diagnostics: subscribers time silence by their own clock)."""

    replica_id: str
    seq: int
    ts: float
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValidationError included) on anything but a well-formed batch."""
    return _decoder.decode(data)
