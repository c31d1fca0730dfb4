"""The block table of a step, built from rows kept between steps (vLLM's persistent batch, for this one table).

Building it from every running request's block ids each step cost O(batch x blocks) Python work (2 ms a step at
128 requests of 2k tokens on a 2-core Xeon: benchmarks/host_step.py), all of it redone though a request gains a
block only every `block_size` tokens. Here each request keeps a row of one host tensor; a step writes only the
blocks appended since the last one, then gathers its requests' rows in one indexing op.

It relies on `Request.block_ids` being only ever extended in place: anything else (freed, taken over, a prefix
swapped for the cached copy) assigns a new list, which this notices by identity and writes the row anew.
"""

from __future__ import annotations

import torch

from vlserve.core.request import Request


class BlockTables:
    def __init__(self, num_rows: int, max_blocks: int):
        """`num_rows`: at least the most requests one step runs; `max_blocks`: the most blocks one request holds."""
        self.table = torch.zeros(num_rows, max_blocks, dtype=torch.long)
        self._row_of: dict[str, int] = {}  # request id -> its row
        self._written: list[tuple[list[int] | None, int]] = [(None, 0)] * num_rows  # the list a row holds, how much
        self._free = list(range(num_rows - 1, -1, -1))

    def gather(self, reqs: list[Request], num_blocks: list[int]) -> torch.Tensor:
        """[len(reqs), max(num_blocks)]: each request's first `num_blocks[i]` block ids, zeros after them."""
        rows = [self._row(req, reqs) for req in reqs]
        width = max(num_blocks)
        if len(rows) == 1:  # (batch 1: one slice, not an index tensor)
            out = self.table[rows[0] : rows[0] + 1, :width].clone()
        else:
            out = self.table[torch.tensor(rows, dtype=torch.long), :width]
        # A row is zeros past the blocks written into it: only a request running over fewer blocks than it holds
        # needs the rest of its row cleared.
        if any(n != self._written[row][1] for row, n in zip(rows, num_blocks)):
            lens = torch.tensor(num_blocks, dtype=torch.long)
            out.masked_fill_(torch.arange(width) >= lens.unsqueeze(1), 0)
        return out

    def _row(self, req: Request, step: list[Request]) -> int:
        ids = req.block_ids
        row = self._row_of.get(req.request_id)
        if row is None:
            row = self._take_row(step)
            self._row_of[req.request_id] = row
        held, n = self._written[row]
        if held is ids and len(ids) == n:  # (most steps: no new block)
            return row
        if len(ids) > self.table.shape[1]:  # (a bound the caller got wrong: room is made, once)
            self._grow(self.table.shape[0], len(ids))
        if held is not ids or len(ids) < n:  # another list: written anew, what it does not cover cleared
            self.table[row, len(ids) : n] = 0
            n = 0
        if len(ids) > n:
            self.table[row, n:len(ids)] = torch.tensor(ids[n:], dtype=torch.long)
        self._written[row] = (ids, len(ids))
        return row

    def _take_row(self, step: list[Request]) -> int:
        if not self._free:  # rows of requests this step does not run (finished, preempted) go back
            running = {r.request_id for r in step}
            for rid in [rid for rid in self._row_of if rid not in running]:
                row = self._row_of.pop(rid)
                self.table[row, : self._written[row][1]] = 0
                self._written[row] = (None, 0)
                self._free.append(row)
        if not self._free:  # more requests in one step than rows
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
            self._written += [(None, 0)] * rows
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        table = torch.zeros(rows, width, dtype=torch.long)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = table
