"""Which leading blocks of a prompt are shared by different conversations: a chat template, a system prompt, a
tools list. A cached shared prefix says nothing about where a conversation lives (whichever replica served
anything first holds it), so the router weighs only the blocks past it when it places a request.

A block hash the router has seen followed by two different next blocks is a fork: conversations went apart
there. Every block up to the deepest fork on a prompt's path is common. A prompt whose hashes stop early (a
picture the router has not laid out yet, which by then nobody has seen) goes on with something new: a new
successor, so the second new chat after a shared system prompt already finds that prompt common. What the
router has never seen two ways is not common: a chat's own turns, each extending the last, never fork (editing
an earlier message does: that chat is then placed like a new one).

Bounded: the least recently seen hashes are forgotten past `max_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

FORK = b"fork"  # two different successors seen
NEW = b"new"  # a successor nobody can have seen (the rest of a prompt not hashed yet)
DEFAULT_MAX_HASHES = 1 << 17  # ~20 MB at worst


class SharedPrefixes:
    def __init__(self, max_hashes: int = DEFAULT_MAX_HASHES):
        if max_hashes <= 0:
            raise ValueError("max_hashes must be positive")
        self.max_hashes = max_hashes
        self._next: OrderedDict[bytes, bytes | None] = OrderedDict()  # hash -> its successor, FORK, or None

    def observe(self, hashes: Sequence[bytes], whole: bool = True) -> int:
        """Records the prompt's path and returns how many of its leading blocks are common (the deepest fork
        on it, this prompt counted). `whole`: the hashes cover every full block of the prompt (else what
        follows the last one is new)."""
        common = 0
        last = len(hashes) - 1
        for i, h in enumerate(hashes):
            nxt = hashes[i + 1] if i < last else (None if whole else NEW)
            seen = self._next.get(h)
            if seen is None:
                self._next[h] = nxt
            elif seen is not FORK and nxt is not None and (seen != nxt or nxt is NEW):
                self._next[h] = FORK
            self._next.move_to_end(h)
            if self._next[h] is FORK:
                common = i + 1
        while len(self._next) > self.max_hashes:
            self._next.popitem(last=False)
        return common

    def __len__(self) -> int:
        return len(self._next)
