"""The step's block table from rows kept between steps (engine.block_tables): whatever happens to the requests'
block ids between steps (blocks appended, freed, taken over, a prefix swapped for the cached copy, requests
leaving, more requests than rows, more blocks than the width), each step's table equals the one built afresh."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from vlserve.engine.block_tables import BlockTables


def fresh(reqs, num_blocks) -> torch.Tensor:
    """The table as it was built before: every row from the request's list, zeros after its blocks."""
    width = max(num_blocks)
    return torch.tensor([r.block_ids[:n] + [0] * (width - n) for r, n in zip(reqs, num_blocks)], dtype=torch.long)


def test_every_step_equals_the_table_built_afresh():
    rng = random.Random(0)
    tables = BlockTables(num_rows=4, max_blocks=6)
    reqs = {i: SimpleNamespace(request_id=f"r{i}", block_ids=[]) for i in range(12)}
    next_block = iter(range(1, 10**6))
    for _ in range(400):
        for r in reqs.values():
            what = rng.random()
            if what < 0.5:  # a block or a few appended in place
                r.block_ids.extend(next(next_block) for _ in range(rng.randint(0, 2)))
            elif what < 0.55:  # freed (preempted, finished): a new list
                r.block_ids = []
            elif what < 0.6 and r.block_ids:  # a prefix swapped for the cached copy: a new list
                r.block_ids = [next(next_block)] + r.block_ids[1:]
            elif what < 0.62:  # taken over from a peer's write: a new list
                r.block_ids = [next(next_block) for _ in range(rng.randint(1, 3))]
        # a step runs some requests (up to 8: more than the 4 rows), each over some of its blocks
        step = [r for r in rng.sample(list(reqs.values()), rng.randint(1, 8)) if r.block_ids]
        if not step:
            continue
        num_blocks = [rng.randint(1, len(r.block_ids)) for r in step]
        assert torch.equal(tables.gather(step, num_blocks), fresh(step, num_blocks))
        for row, (_, n) in enumerate(tables._written):  # every row is zeros past what was written into it
            assert not tables.table[row, n:].any()
    assert tables.table.shape[0] >= 8 and tables.table.shape[1] > 6  # it grew to what the steps needed


def test_a_step_writes_only_what_was_appended():
    tables = BlockTables(num_rows=2, max_blocks=8)
    req = SimpleNamespace(request_id="r", block_ids=[5, 6])
    tables.gather([req], [2])
    tables.table[tables._row_of["r"], :2] = -1  # what was written stays as it was: not written again
    req.block_ids.append(7)
    assert tables.gather([req], [3]).tolist() == [[-1, -1, 7]]
    req.block_ids = [5, 6, 7]  # a new list: written anew
    assert tables.gather([req], [3]).tolist() == [[5, 6, 7]]
