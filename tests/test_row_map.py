"""How a transfer is cut into chunks (#26 item 5): media rows take room for media tokens only, item after item,
so a run of blocks covers as many text tokens as come; KV rows take one per token. The receiver holds a peer to
the same cut, and the rows of every item are found by its index."""

from __future__ import annotations

import torch

from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.disagg.messages import ItemMeta, RowSegment, TransferChunk
from vlserve.disagg.received import ReceivedChunks
from vlserve.disagg.row_map import RowMap
from vlserve.disagg.transports.base import ChunkTokens

ITEMS = [ItemMeta(3, 5, (1, 2, 10), "a"), ItemMeta(20, 4, (1, 4, 4), "b")]  # tokens 3..7 and 20..23 of 30


def _cuts(row_map: RowMap, capacity: int, total: int) -> list[tuple[int, int]]:
    cuts, start = [], 0
    while start < total:
        end = row_map.chunk_end(start, capacity, total)
        cuts.append((start, end))
        start = end
    return cuts


def test_media_chunks_end_where_the_run_is_full_of_rows():
    media = RowMap(ITEMS, every_token=False)
    assert [media.rows_before(t) for t in (0, 3, 5, 8, 20, 22, 24, 30)] == [0, 0, 2, 5, 5, 7, 9, 9]
    # 4 rows a run: the first picture is cut after its 4th row; the text after it rides along for free.
    assert _cuts(media, 4, 30) == [(0, 7), (7, 23), (23, 30)]
    assert _cuts(media, 9, 30) == [(0, 30)]  # the whole prompt in 9 rows (it has 30 tokens)
    assert _cuts(RowMap(ITEMS, every_token=True), 16, 30) == [(0, 16), (16, 30)]
    prompt = ProcessedPrompt(list(range(30)), [MultiModalItem(it.offset, it.num_tokens, None, it.layout)
                                               for it in ITEMS], torch.zeros(3, 30, dtype=torch.int64), 0)
    assert (prompt.media_row(0), prompt.media_row(1), prompt.rows_in_blocks) == (0, 5, 9)


def _chunk(start: int, end: int, segments: list[tuple[int, int]], run: list[int]) -> TransferChunk:
    return TransferChunk("r", 0, start, end - start, 30, 0, ITEMS, run, [RowSegment(*s) for s in segments],
                         partial=end < 30)


def _tokens(start: int, end: int) -> ChunkTokens:
    return ChunkTokens(torch.arange(start, end), torch.zeros(end - start, 3, dtype=torch.int64), 0)


def test_the_receiver_holds_a_peer_to_the_cut_and_assembles_the_prompt():
    received = ReceivedChunks(every_token=False, block_tokens=4, max_model_len=64)
    first = _chunk(0, 7, [(3, 4)], [5])
    assert received.problems(first, [5]) == []
    received.add(first, _tokens(0, 7))
    assert (received.tokens, received.rows, received.rows_left) == (7, 4, 5)
    early = _chunk(7, 24, [(7, 1), (20, 4)], [6, 2])  # stops at 24 though the 8 slots hold all 5 rows left
    assert received.problems(early, [6, 2]) == ["17 tokens where 23 fit"]
    text_rows = _chunk(7, 30, [(7, 1), (10, 1), (20, 4)], [6, 2])  # a row for a text token
    assert received.problems(text_rows, [6, 2]) == ["rows that do not match this chunk's tokens"]
    last = _chunk(7, 30, [(7, 1), (20, 4)], [6, 2])
    assert received.problems(last, [6, 2]) == []
    received.add(last, _tokens(7, 30))
    prompt = received.prompt("text", [5, 6, 2])
    assert prompt.prompt_token_ids == list(range(30)) and prompt.rows_in_blocks == 9 and not prompt.kv_in_blocks
