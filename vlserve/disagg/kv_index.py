"""An approximate view of several replicas' prefix caches, built from their KV cache events (core/kv_events.py).

A cache-aware router asks `longest_prefixes(block_hashes)`: for every replica, how many leading blocks of a
request (`core.block_hash.prompt_block_hashes`) it holds, as far as its events said.

The view is a hint, never a promise: a router that overestimates sends a request to a replica that recomputes it,
no more. What the index guarantees is that it never goes on believing a replica holds blocks after evidence that
its view may be wrong:

- **Gaps.** Every batch carries a sequence number. A batch out of sequence (one lost: the publisher drops when a
  subscriber lags; or reordered) or from a new publisher run (the replica restarted, its cache is empty) means
  removals may have been missed: the replica's blocks are forgotten and it is *cold*. Events after the gap are
  applied again (a late, older batch is ignored), so the view grows back, but only from blocks stored again: a
  block cached before the gap that stays cached is unknown until evicted and stored anew. The view is then a
  subset of the truth. A fresh publisher starting at sequence 0 is a clean start, not a gap.
- **Silence.** A replica publishes at least a keepalive every second, and a busy one after every engine step;
  one not heard from for `silence_timeout_s` (by this process's clock: publishers' clocks may disagree) is cold:
  it may be dead, or its events may not reach us, so queries count nothing cached there. Its blocks are kept,
  not forgotten: silence loses no event by itself (the sequence numbers say when one was lost), and a replica in
  one long engine step (a large prefill on a loaded machine) is silent for no other reason. Its next batch in
  sequence makes it warm with its whole view; a gap or a new publisher forgets it as above.
- A cold replica turns warm again at its next batch in sequence. `longest_prefix` of a replica cold after a gap
  answers from what it learned since (0 right after); of a silent one, 0.
- **Memory.** At most `max_blocks_per_replica` hashes per replica: storing one more drops its oldest-stored hash
  (the one most likely evicted by the replica's own LRU meanwhile).

Thread-safe: a subscriber thread applies batches while request handlers query.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vlserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

DEFAULT_SILENCE_TIMEOUT_S = 10.0
DEFAULT_MAX_BLOCKS = 1 << 20  # ~100 MB per replica at worst; 16M tokens of cache at block size 16


@dataclass
class ReplicaView:
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # oldest stored first
    publisher: str | None = None  # the publisher run whose stream we follow
    next_seq: int | None = None
    last_heard: float | None = None
    cold_reason: str | None = "never heard from"
    block_size: int | None = None  # as its last BlockStored said
    gaps: int = 0  # sequence gaps, reorders and restarts seen
    dropped_by_bound: int = 0  # hashes dropped by max_blocks_per_replica
    silent: bool = False  # cold for silence: its blocks are kept, hidden from queries until it is heard again


class KVIndex:
    def __init__(self, silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
                 max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS, clock: Callable[[], float] = time.monotonic):
        if silence_timeout_s <= 0 or max_blocks_per_replica <= 0:
            raise ValueError("silence_timeout_s and max_blocks_per_replica must be positive")
        self.silence_timeout_s = silence_timeout_s
        self.max_blocks = max_blocks_per_replica
        self._clock = clock
        self._replicas: dict[str, ReplicaView] = {}
        self._holders: dict[bytes, set[str]] = {}  # block hash -> replicas holding it
        self._lock = threading.Lock()

    # ---- membership -------------------------------------------------------------------------------------
    def add_replica(self, name: str) -> None:
        with self._lock:
            self._replicas.setdefault(name, ReplicaView())

    def remove_replica(self, name: str) -> None:
        with self._lock:
            if name in self._replicas:
                self._forget(name, "removed", log=False)
                del self._replicas[name]

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def view(self, name: str) -> ReplicaView:
        """The replica's state (read-only by convention): blocks, sequence, cold reason, counters."""
        with self._lock:
            self._expire()
            return self._replicas[name]

    def is_cold(self, name: str) -> bool:
        return self.view(name).cold_reason is not None

    # ---- events -----------------------------------------------------------------------------------------
    def apply(self, name: str, batch: KVEventBatch) -> None:
        """One batch from replica `name` (added on first sight)."""
        with self._lock:
            view = self._replicas.setdefault(name, ReplicaView())
            view.last_heard = self._clock()
            view.silent = False
            if batch.replica_id != view.publisher:
                clean = batch.seq == 0  # a publisher's first batch: we have seen its whole stream
                if view.publisher is not None:
                    self._forget(name, f"new publisher {batch.replica_id}")
                    view.gaps += 1
                view.publisher = batch.replica_id
                view.cold_reason = None if clean else f"joined {batch.replica_id} at seq {batch.seq}"
            elif batch.seq != view.next_seq:
                view.gaps += 1
                self._forget(name, f"sequence gap: expected {view.next_seq}, got {batch.seq}")
                if batch.seq < view.next_seq:
                    return  # late or repeated: older than what was applied already
            else:
                view.cold_reason = None
            view.next_seq = batch.seq + 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    view.block_size = event.block_size
                    for h in event.block_hashes:
                        self._store(name, view, h)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        self._drop(name, view, h)
                elif isinstance(event, AllBlocksCleared):
                    for h in list(view.blocks):
                        self._drop(name, view, h)

    def expire(self) -> None:
        """Turns replicas silent for longer than the timeout cold (queries do this too)."""
        with self._lock:
            self._expire()

    # ---- queries ----------------------------------------------------------------------------------------
    def longest_prefix(self, name: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `block_hashes` replica `name` holds (0 for an unknown replica)."""
        with self._lock:
            self._expire()
            view = self._replicas.get(name)
            if view is None or view.silent:
                return 0
            n = 0
            for h in block_hashes:
                if h not in view.blocks:
                    break
                n += 1
            return n

    def num_blocks(self, name: str) -> int:
        """Blocks replica `name` holds as far as its events tell (0 while cold or unknown)."""
        with self._lock:
            self._expire()
            view = self._replicas.get(name)
            return 0 if view is None or view.cold_reason is not None else len(view.blocks)

    def longest_prefixes(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """`longest_prefix` of every known replica, in one pass over the hashes."""
        with self._lock:
            self._expire()
            result = dict.fromkeys(self._replicas, 0)
            alive = set(result)
            for i, h in enumerate(block_hashes):
                alive &= self._holders.get(h, set())
                if not alive:
                    break
                for name in alive:
                    result[name] = i + 1
            for name, view in self._replicas.items():
                if view.silent:
                    result[name] = 0
            return result

    # ---- internals (lock held) ----------------------------------------------------------------------------
    def _store(self, name: str, view: ReplicaView, h: bytes) -> None:
        if h in view.blocks:
            view.blocks.move_to_end(h)
            return
        view.blocks[h] = None
        self._holders.setdefault(h, set()).add(name)
        if len(view.blocks) > self.max_blocks:
            oldest, _ = view.blocks.popitem(last=False)
            self._unhold(name, oldest)
            view.dropped_by_bound += 1

    def _drop(self, name: str, view: ReplicaView, h: bytes) -> None:
        if h in view.blocks:
            del view.blocks[h]
            self._unhold(name, h)

    def _unhold(self, name: str, h: bytes) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._holders[h]

    def _forget(self, name: str, reason: str, log: bool = True) -> None:
        view = self._replicas[name]
        if log and (view.blocks or view.cold_reason is None):
            logger.warning("KV events of replica %s: %s; its cached blocks are forgotten", name, reason)
        for h in view.blocks:
            self._unhold(name, h)
        view.blocks.clear()
        view.cold_reason = reason
        view.silent = False

    def _expire(self) -> None:
        now = self._clock()
        for name, view in self._replicas.items():
            if (view.cold_reason is None and view.last_heard is not None
                    and now - view.last_heard > self.silence_timeout_s):
                logger.warning("KV events of replica %s: silent for %.1fs; counted cold until heard again", name,
                               now - view.last_heard)
                view.cold_reason, view.silent = f"silent for {now - view.last_heard:.1f}s", True
