"""An LRU bounded by bytes, for compiled constraints; keys are digests, so a 1 MiB spec is not kept twice."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

# A compiled matcher's memory, measured with glibc's mallinfo2 (llguidance 1.9, byte-level BPE tokenizers of
# 1k and 9k tokens): 12 bytes per grammar character for a long literal regex, 43 for a 100k-way alternation,
# 42 for 4000 Lark rules, 91 for a JSON schema of 3000 properties, plus ~130 KB for the smallest schema.
# Entries are charged this upper estimate (measuring in place would count the other threads' allocations).
MATCHER_BYTES_PER_CHAR = 96
MATCHER_BASE_BYTES = 160 * 1024


def spec_digest(key: tuple) -> bytes:
    """A fixed-size key for a spec's `key` (kind, value, options)."""
    return hashlib.blake2b(repr(key).encode("utf-8", "surrogatepass"), digest_size=20).digest()


class ByteLRU:
    """digest -> value, evicting the least recently used entries once their sizes add up past `max_bytes`.
    Thread-safe: builders on several threads fill it."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes, default: Any = None) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return default
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: bytes, value: Any, size: int) -> None:
        """Keeps `value` charged `size` bytes; one bigger than the whole budget is not kept at all."""
        size += len(key) + 64  # the entry's own bookkeeping
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed

    def __len__(self) -> int:
        return len(self._entries)
