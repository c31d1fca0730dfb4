"""Which encoder outputs the model runner holds, keyed by mm_hash; the runner only stores the tensors.

An entry is referenced by the requests that still need it: from the step its placeholder is first scheduled
until the placeholder is fully computed. Unreferenced entries stay, in LRU order, so a later request with the
same picture skips the ViT; they are evicted whole, and only when room is needed. Capacity counts embedding
rows of the LM's hidden size: a media token costs one, or 1 + levels on a model with DeepStack features (they
are held next to the embedding). 0 disables caching across requests (an entry is dropped as soon as nobody
needs it).
"""

from __future__ import annotations

from collections import OrderedDict

from vlserve.core.prompt import MultiModalItem
from vlserve.model.config_types import ModelConfig

Holder = tuple[str, int]  # (request or transfer id, item index): one use of an entry


class EncoderCacheManager:
    def __init__(self, capacity: int, rows_per_token: int = 1):
        self.capacity = capacity
        self.rows_per_token = rows_per_token
        self.used = 0
        self._size: dict[str, int] = {}  # mm_hash -> rows held
        self._holders: dict[str, set[tuple[str, int]]] = {}  # mm_hash -> (request id, item index) still needing it
        self._freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, oldest first
        self.queries = 0
        self.hits = 0

    @classmethod
    def for_model(cls, capacity: int, model: ModelConfig) -> "EncoderCacheManager":
        return cls(capacity, model.rows_per_media_token)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._size

    def __len__(self) -> int:
        return len(self._size)

    def fits_ever(self, num_tokens: int) -> bool:
        return not self.enabled or num_tokens * self.rows_per_token <= self.capacity

    def lookup(self, holder: Holder, item: MultiModalItem) -> bool:
        """Count a query; on a hit `holder` holds the entry and no encoding is needed."""
        self.queries += 1
        if item.mm_hash not in self._size:
            return False
        self.hits += 1
        self._hold(item.mm_hash, holder)
        return True

    def can_allocate(self, num_tokens: int, protect: set[str] = frozenset()) -> bool:
        """Room for `num_tokens` new media tokens, evicting only unreferenced entries not in `protect`."""
        if not self.enabled:
            return True
        evictable = sum(self._size[h] for h in self._freeable if h not in protect)
        return self.capacity - self.used + evictable >= num_tokens * self.rows_per_token

    def allocate(self, holder: Holder, item: MultiModalItem) -> list[str]:
        """Reserve room for an item about to be encoded; returns the hashes evicted to make room."""
        self.queries += 1  # a miss
        evicted = []
        rows = item.num_tokens * self.rows_per_token
        while self.enabled and self.capacity - self.used < rows:
            victim, _ = self._freeable.popitem(last=False)
            self._drop(victim)
            evicted.append(victim)
        self._size[item.mm_hash] = rows
        self.used += rows
        self._holders[item.mm_hash] = set()
        self._hold(item.mm_hash, holder)
        return evicted

    def release(self, holder: Holder, item: MultiModalItem) -> list[str]:
        """Drop this holder's claim; returns hashes the runner may forget now (only when caching is off)."""
        mm_hash = item.mm_hash
        holders = self._holders.get(mm_hash)
        if holders is None or holder not in holders:
            return []
        holders.discard(holder)
        if holders:
            return []
        if not self.enabled:
            self._drop(mm_hash)
            return [mm_hash]
        self._freeable[mm_hash] = None
        return []

    def release_all(self, owner: str, items: list[MultiModalItem]) -> list[str]:
        return [h for i, item in enumerate(items) for h in self.release((owner, i), item)]

    def discard(self, mm_hash: str) -> None:
        """Forget an entry whatever holds it (its encoding failed: there is no output to hand out). Its holders'
        later releases find nothing and do nothing."""
        if mm_hash in self._size:
            self._freeable.pop(mm_hash, None)
            self._drop(mm_hash)

    def holds(self, holder: Holder, item: MultiModalItem) -> bool:
        return holder in self._holders.get(item.mm_hash, ())

    def _hold(self, mm_hash: str, holder: tuple[str, int]) -> None:
        self._holders[mm_hash].add(holder)
        self._freeable.pop(mm_hash, None)

    def _drop(self, mm_hash: str) -> None:
        self.used -= self._size.pop(mm_hash)
        del self._holders[mm_hash]

    def check_integrity(self) -> None:
        if self.used != sum(self._size.values()):
            raise AssertionError("encoder cache: used tokens disagree with entries")
        for h, holders in self._holders.items():
            if bool(holders) == (h in self._freeable):
                raise AssertionError(f"encoder cache: {h} is referenced and freeable at once (or neither)")
        if self.enabled and self.used > self.capacity:
            raise AssertionError("encoder cache over capacity")
