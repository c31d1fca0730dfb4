"""Which receive rows a prompt's tokens take, the rule sender and receiver both follow to cut a transfer into
chunks.

Media rows (from an encoder): one row per media token, item after item, nothing for text; so a long text with a
small picture reserves the picture's rows only, and item i's rows start where the items before it end
(`ProcessedPrompt.media_row`). KV rows (from a prefill instance): one row per token, then, for a hybrid model,
`tail_rows` rows of linear states (engine.state_rows) after the last token's, sent with the last token.

A chunk covers prompt tokens [start, end) and fills the run of blocks it is sent into from its first slot. It
goes as far as the run holds the rows: up to the first media token whose row does not fit (text tokens take no
room, so they ride along with whatever precedes them), or the prompt's end (with the tail rows: the last token
goes only with them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Item(Protocol):
    offset: int
    num_tokens: int


class RowMap:
    def __init__(self, items: Sequence[_Item], every_token: bool, tail_rows: int = 0):
        self.every_token, self.tail_rows = every_token, tail_rows
        self.spans = [(it.offset, it.num_tokens) for it in items]

    def rows_before(self, token: int) -> int:
        """Rows of the prompt's tokens [0, token)."""
        if self.every_token:
            return token
        return sum(min(max(token - offset, 0), n) for offset, n in self.spans)

    def rows_through(self, token: int, total: int) -> int:
        """Rows of the prompt's tokens [0, token) of `total`, and the tail rows once they are all in."""
        return self.rows_before(token) + (self.tail_rows if token == total else 0)

    def chunk_end(self, start: int, capacity: int, total: int) -> int:
        """The end of the chunk that starts at token `start` in a run of `capacity` rows."""
        limit = self.rows_before(start) + capacity
        if self.rows_through(total, total) <= limit:
            return total
        lo, hi = start, total  # rows_before(lo) <= limit < rows_before(hi): the end lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.rows_before(mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo
