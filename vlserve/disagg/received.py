"""What a receiver has of one transfer so far: the checks that each new chunk continues it exactly (tokens, blocks,
rows, the header's facts), the token ids and positions that travelled beside the rows, and the prompt they add
up to once the last chunk is in."""

from __future__ import annotations

import torch

from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.disagg.messages import TransferChunk
from vlserve.disagg.row_map import RowMap
from vlserve.disagg.transports.base import ChunkTokens

MAX_MM_HASH_CHARS = 128


class ReceivedChunks:
    def __init__(self, every_token: bool, block_tokens: int, max_model_len: int, tail_rows: int = 0):
        """`every_token`: KV rows for every token (from a prefill instance), not media rows (from an encoder);
        `tail_rows`: rows after the last token's (a hybrid model's linear states, from a prefill instance)."""
        self.every_token, self.block_tokens, self.max_model_len = every_token, block_tokens, max_model_len
        self.tail_rows = tail_rows
        self.first: TransferChunk | None = None
        self.row_map: RowMap | None = None
        self.tokens = 0  # tokens [0, tokens) have arrived
        self.rows = 0  # and their rows, in the blocks from the transfer's first on
        self._fill_ids: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []

    def problems(self, header: TransferChunk, run: list[int]) -> list[str]:
        """What is wrong with `header` as the next chunk, sent into `run` (nothing: an empty list)."""
        first = self.first or header
        problems = []
        if not 0 < header.total_tokens <= self.max_model_len:
            problems.append(f"a prompt of {header.total_tokens} tokens (max_model_len is {self.max_model_len})")
        if header.start_token != self.tokens or header.block_ids != run:
            problems.append("a chunk for the wrong tokens or blocks")
        if (header.total_tokens, header.position_delta, header.items) != (first.total_tokens, first.position_delta,
                                                                       first.items):
            problems.append("a chunk that contradicts the first one")
        if not _items_in_order(header):
            problems.append("media items that overlap or run past the prompt")
        if any(len(it.mm_hash) > MAX_MM_HASH_CHARS for it in header.items):
            problems.append("an oversized mm_hash")
        if problems:
            return problems
        row_map = self.row_map or RowMap(header.items, self.every_token, self.tail_rows)
        end = row_map.chunk_end(self.tokens, len(run) * self.block_tokens, header.total_tokens)
        if header.num_tokens != end - self.tokens or header.partial != (end < header.total_tokens):
            problems.append(f"{header.num_tokens} tokens where {end - self.tokens} fit")
        # Exactly one row for every token of the chunk that has one, in order: none missing (its slot would hold a
        # stale row of another request), none extra, none for text.
        if self.every_token:
            rows = [(header.start_token, header.num_tokens)]
            if self.tail_rows and end == header.total_tokens:  # the states, after the last token's row
                rows.append((header.total_tokens, self.tail_rows))
        else:
            chunk_end = header.start_token + header.num_tokens
            media = [(max(it.offset, header.start_token), min(it.offset + it.num_tokens, chunk_end))
                     for it in header.items]
            rows = [(lo, hi - lo) for lo, hi in media if lo < hi]
        if [(s.token, s.num_rows) for s in header.segments] != rows:
            problems.append("rows that do not match this chunk's tokens")
        if header.handoff is not None and header.partial:
            problems.append("a first token before the last chunk")
        return problems

    def add(self, header: TransferChunk, tokens: ChunkTokens) -> None:
        """A chunk that passed `problems` has landed: its rows are in the blocks, its tokens here."""
        self.first = self.first or header
        self.row_map = self.row_map or RowMap(header.items, self.every_token, self.tail_rows)
        self.tokens = header.start_token + header.num_tokens
        self.rows = self.row_map.rows_through(self.tokens, header.total_tokens)
        self._fill_ids.append(tokens.fill_ids)
        self._positions.append(tokens.positions)

    @property
    def rows_left(self) -> int:
        """Rows still to come (what a resume needs room for)."""
        total = self.first.total_tokens
        return self.row_map.rows_through(total, total) - self.rows

    def prompt(self, text: str, blocks: list[int]) -> ProcessedPrompt:
        """The prompt as it arrived, its rows in `blocks` (still to be checked like anything the engine admits)."""
        items = [MultiModalItem(it.offset, it.num_tokens, None, tuple(it.layout), it.mm_hash,
                                modality=it.modality)
                 for it in self.first.items]
        return ProcessedPrompt(torch.cat(self._fill_ids).tolist(), items, torch.cat(self._positions).T.contiguous(),
                               self.first.position_delta, text, block_rows=blocks, kv_in_blocks=self.every_token)


def _items_in_order(header: TransferChunk) -> bool:
    end = 0
    for it in header.items:
        if it.offset < end or it.num_tokens <= 0 or it.offset + it.num_tokens > header.total_tokens:
            return False
        end = it.offset + it.num_tokens
    return True
