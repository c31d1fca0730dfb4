"""The engine's prefix-cache events, relayed to Dynamo's KV router with the tokens it hashes.

Our engine publishes block hashes only (`--kv-events-endpoint`, core/kv_events.py); Dynamo's router hashes the
tokens of each stored block itself (xxh3 over token ids), so the relay keeps, for every block of the prompts this
worker sent to its engine, the tokens the router will see: the prompt's token ids with each media item's
placeholder tokens replaced by Dynamo's per-item pad value (from the hash its frontend computed for the item), as
its frontend does for the request's `routing_token_ids`. A stored block whose tokens are not known (a generated
block, or one that fell out of the bounded map) ends the run published: the router learns prefixes only.

Thread-safety: `remember` runs on the front end's worker threads, `run` on the relay's own thread; the map is
guarded by a lock, the ZeroMQ socket lives in the relay thread alone.
"""

from __future__ import annotations

import array
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable

import msgspec
import zmq

from vlserve.core.block_hash import chain_root, extend_block_hashes
from vlserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

logger = logging.getLogger(__name__)

# Dynamo's canonical media pad value (its kv router and frontend compute the same): 10^6 + low 30 bits of the
# item's 64-bit routing hash, itself the first 16 hex digits of the hash its frontend sends in extra_args.mm_hashes.
PAD_BASE = 1_000_000
PAD_MASK = (1 << 30) - 1


def pad_value(mm_hash_hex: str) -> int:
    return PAD_BASE + (int(mm_hash_hex[:16], 16) & PAD_MASK)


def as_i64(block_hash: bytes) -> int:
    """Dynamo's block hashes are signed 64-bit integers: the first 8 bytes of ours."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def routing_tokens(token_ids: Sequence[int], items: Sequence[Any], mm_hashes: Sequence[str],
                   placeholders: set[int]) -> list[int]:
    """The prompt as Dynamo's router sees it: each item's placeholder tokens (in prompt order) replaced by the pad
    value of its hash. With a different number of hashes than items nothing is replaced (those blocks then
    never match, which costs a cache hit, not a wrong answer)."""
    tokens = list(token_ids)
    ordered = sorted(items, key=lambda it: it.offset)
    if len(ordered) != len(mm_hashes):
        return tokens
    for item, mm_hash in zip(ordered, mm_hashes):
        try:
            pad = pad_value(mm_hash)
        except ValueError:
            continue
        for i in range(item.offset, min(item.end, len(tokens))):
            if tokens[i] in placeholders:
                tokens[i] = pad
    return tokens


class KVEventRelay:
    def __init__(self, endpoint: str, block_size: int, max_blocks: int):
        """`endpoint`: the engine's KV events socket; `max_blocks`: blocks whose tokens are kept (LRU), a few
        times the engine's pool so every cached block stays known."""
        self.endpoint, self.block_size, self.max_blocks = endpoint, block_size, max_blocks
        # our block hash -> its routing tokens (int64 bytes: a block is one small object, not block_size ints)
        self._tokens: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._published: set[bytes] = set()  # blocks the router was told about (relay thread only)
        self._next: tuple[str, int] | None = None  # the batch expected next: (publisher run, seq)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relayed_stored = self.relayed_removed = self.unknown_blocks = 0

    def remember(self, token_ids: Sequence[int], items: Sequence[Any], routing: Sequence[int]) -> None:
        """Before the request goes to the engine: the routing tokens of each full block of its prompt."""
        hashes: list[bytes] = []
        extend_block_hashes(token_ids, items, self.block_size, hashes, [], chain_root(None))
        bs = self.block_size
        with self._lock:
            for i, h in enumerate(hashes):
                self._tokens[h] = array.array("q", routing[i * bs:(i + 1) * bs]).tobytes()
                self._tokens.move_to_end(h)
            while len(self._tokens) > self.max_blocks:
                self._tokens.popitem(last=False)

    # ---- the relay thread --------------------------------------------------------------------------------
    def start(self, publisher: Any, on_tick: Callable[[], None] | None = None) -> None:
        """`publisher`: Dynamo's KvEventPublisher (publish_stored / publish_removed); `on_tick` runs every poll
        (the load snapshot)."""
        self._thread = threading.Thread(target=self.run, args=(publisher, on_tick), name="vlserve-dynamo-kv",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self, publisher: Any, on_tick: Callable[[], None] | None = None, poll_ms: int = 100) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 10_000)  # batches buffered before ZeroMQ drops (the seq gap then says so)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if sock.poll(poll_ms):
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.apply(data, publisher)
                if on_tick is not None:
                    on_tick()
        finally:
            sock.close(linger=0)

    def apply(self, data: bytes, publisher: Any) -> None:
        try:
            batch = decode_batch(data)
        except msgspec.DecodeError as e:
            logger.warning("undecodable KV events message dropped: %s", e)
            return
        if self._next is not None and (batch.replica_id, batch.seq) != self._next and self._published:
            # A lost batch (or a restarted engine): what the router was told may be stale; start over.
            logger.warning("KV events %s lost before seq %d: the router forgets this worker's blocks",
                           batch.replica_id, batch.seq)
            self._removed(list(self._published), publisher)
        self._next = (batch.replica_id, batch.seq + 1)
        for event in batch.events:
            try:
                if isinstance(event, BlockStored):
                    self._stored(event, publisher)
                elif isinstance(event, BlockRemoved):
                    self._removed([h for h in event.block_hashes if h in self._published], publisher)
                elif isinstance(event, AllBlocksCleared):
                    self._removed(list(self._published), publisher)
            except Exception:  # the router's view degrades; serving goes on
                logger.exception("a KV event could not be relayed to Dynamo")

    def _stored(self, event: BlockStored, publisher: Any) -> None:
        parent = event.parent_hash
        if parent is not None and parent not in self._published:
            self.unknown_blocks += len(event.block_hashes)
            return  # the router would not find the parent: this chain is not relayed
        run: list[tuple[bytes, array.array]] = []
        with self._lock:
            for h in event.block_hashes:
                packed = self._tokens.get(h)
                if packed is None or len(packed) != 8 * self.block_size:
                    break
                run.append((h, array.array("q", packed)))
        self.unknown_blocks += len(event.block_hashes) - len(run)
        if not run:
            return
        publisher.publish_stored(token_ids=[t for _, tokens in run for t in tokens],
                                 num_block_tokens=[self.block_size] * len(run),
                                 block_hashes=[as_i64(h) for h, _ in run],
                                 parent_hash=None if parent is None else as_i64(parent))
        self._published.update(h for h, _ in run)
        self.relayed_stored += len(run)

    def _removed(self, hashes: list[bytes], publisher: Any) -> None:
        if not hashes:
            return
        publisher.publish_removed(block_hashes=[as_i64(h) for h in hashes])
        self._published.difference_update(hashes)
        self.relayed_removed += len(hashes)
