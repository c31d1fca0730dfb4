"""Which receive rows a prompt's tokens take, the rule sender and receiver both follow to cut a transfer into
chunks.

Media rows (from an encoder): one row per media token, item after item, nothing for text; so a long text with a
small picture reserves the picture's rows only, and item i's rows start where the items before it end
(`ProcessedPrompt.media_row`). KV rows (from a prefill instance): one row per token.

A chunk covers prompt tokens [start, end) and fills the run of blocks it is sent into from its first slot. It
goes as far as the run holds the rows: up to the first media token whose row does not fit (text tokens take no
room, so they ride along with whatever precedes them), or the prompt's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Item(Protocol):
    offset: int
    num_tokens: int


class RowMap:
    def __init__(self, items: Sequence[_Item], every_token: bool):
        self.every_token = every_token
        self.spans = [(it.offset, it.num_tokens) for it in items]

    def rows_before(self, token: int) -> int:
        """Rows of the prompt's tokens [0, token)."""
        if self.every_token:
            return token
        return sum(min(max(token - offset, 0), n) for offset, n in self.spans)

    def chunk_end(self, start: int, capacity: int, total: int) -> int:
        """The end of the chunk that starts at token `start` in a run of `capacity` rows."""
        limit = self.rows_before(start) + capacity
        if self.rows_before(total) <= limit:
            return total
        lo, hi = start, total  # rows_before(lo) <= limit < rows_before(hi): the end lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.rows_before(mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo
