"""A KV cache kept by several ranks of one machine, each rank's heads in its own file (engine.ranked_kv), and the
transports writing whole rows into it: every rank gets exactly its heads, in place; a row read back is the row
written; a target that does not describe whole heads is refused before anything is written."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.test_disagg import BACKENDS
from vlserve.core.config import DECODE, PREFILL, kv_cache_shared
from vlserve.disagg.transports.base import check_shards
from vlserve.disagg.transports.shm import ShmTransport
from vlserve.disagg.transports import TRANSPORTS
from vlserve.engine.ranked_kv import RankedKV, heads_cover, shard_rows
from vlserve.engine.transfer_buffers import TransferBuffers

PARTS, DIM, BLOCKS, BLOCK_TOKENS = 6, 4, 8, 4  # 3 layers x key/value; heads of 4 values


def ranked(num_heads: int, heads: list[tuple[int, int]], shared: bool = False) -> RankedKV:
    """Each rank's file as ModelShard makes it (its heads of every plane), rank 0 the owner of the grants."""
    files = [TransferBuffers.create(BLOCKS, BLOCK_TOKENS, PARTS * count * DIM, torch.float32, shared=shared,
                                    parts=PARTS) for _, count in heads]
    return RankedKV(files, heads, num_heads)


def whole_rows(m: int, num_heads: int) -> torch.Tensor:
    return torch.randn(m, PARTS * num_heads * DIM)


# heads split evenly; fewer heads than ranks (each rank a copy of one head); one rank
SPLITS = {"2 ranks": (4, [(0, 2), (2, 2)]), "copies": (1, [(0, 1), (0, 1)]),
          "2 heads at 4 ranks": (2, [(0, 1), (0, 1), (1, 1), (1, 1)]),
          "4 ranks": (4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
          "in any order": (4, [(2, 2), (0, 2)])}


@pytest.mark.parametrize("split", SPLITS)
def test_every_rank_takes_its_heads_and_rows_read_back_whole(split):
    num_heads, heads = SPLITS[split]
    kv = ranked(num_heads, heads)
    rows, blocks = whole_rows(10, num_heads), [5, 2, 7]
    kv.write_rows(blocks, torch.arange(10), rows)
    for rank, (first, count) in enumerate(heads):  # each file holds that rank's heads of every plane
        torch.testing.assert_close(kv.shards[rank].read_rows(blocks, 0, 10),
                                   shard_rows(rows, PARTS, num_heads, first, count).reshape(10, -1), rtol=0, atol=0)
    assert torch.equal(kv.read_rows(blocks, 3, 7), rows[3:])
    slots = kv.shards[0].slots(blocks, torch.arange(10))
    assert torch.equal(kv.read_slots(slots), rows)
    scratch = torch.full((10, kv.layout.width), float("nan"))
    assert kv.read_slots(slots, scratch) is scratch and torch.equal(scratch, rows)
    for first in range(0, PARTS, 2):  # one layer's keys and values: what a prefill sends as that layer is computed
        layer = kv.read_slots(slots, planes=range(first, first + 2))
        assert torch.equal(layer, rows.view(10, PARTS, -1)[:, first : first + 2])
    assert kv.rows_finite(blocks, torch.arange(10))
    assert (kv.num_blocks, kv.block_tokens, kv.layout.width) == (BLOCKS, BLOCK_TOKENS, PARTS * num_heads * DIM)


@pytest.mark.parametrize("split", ["2 ranks", "2 heads at 4 ranks"])
def test_a_value_that_is_not_finite_is_seen_whichever_rank_keeps_it(split):
    """Every file is read, copies too: a rank attends with its own copy."""
    num_heads, heads = SPLITS[split]
    kv = ranked(num_heads, heads)
    blocks = [1, 4]
    kv.write_rows(blocks, torch.arange(8), whole_rows(8, num_heads))
    last = kv.shards[-1]
    assert kv.rows_finite(blocks, torch.arange(8))
    poisoned = last.read_rows(blocks, 5, 1)
    poisoned[0, -1] = float("nan")
    last.write_rows(blocks, torch.tensor([5]), poisoned)
    assert not kv.rows_finite(blocks, torch.arange(8)) and kv.rows_finite(blocks, torch.arange(5))


def test_rank_files_that_do_not_make_one_cache_are_refused():
    with pytest.raises(ValueError, match="do not make one KV cache"):
        RankedKV([TransferBuffers.create(BLOCKS, BLOCK_TOKENS, PARTS * 2 * DIM, torch.float32, shared=False,
                                         parts=PARTS),
                  TransferBuffers.create(BLOCKS + 1, BLOCK_TOKENS, PARTS * 2 * DIM, torch.float32, shared=False,
                                         parts=PARTS)], [(0, 2), (2, 2)], 4)
    for heads in ([(0, 1), (1, 1)], [(0, 1), (2, 2)], [(1, 3), (3, 1)]):
        with pytest.raises(ValueError, match="not each of 4 heads"):
            ranked(4, heads)


def test_a_grant_opened_once_lets_a_peer_write_every_rank():
    kv = ranked(4, [(0, 2), (2, 2)])
    assert all(s.grants is kv.grants for s in kv.shards)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transports_write_whole_rows_into_every_ranks_file(backend):
    kv = ranked(4, [(0, 2), (2, 2)], shared=True)
    receiver, sender = TRANSPORTS[backend](), TRANSPORTS[backend]()
    try:
        target = receiver.register(kv)
        assert len(target.shards) == 2 and target.heads == [(0, 2), (2, 2)]
        blocks, rows = [3, 1], whole_rows(7, 4)
        kv.grants.open("g", blocks)
        target = msgspec.structs.replace(target, grant="g")
        assert sender.write(target, blocks, rows) == rows.numel() * 4
        assert torch.equal(kv.read_rows(blocks, 0, 7), rows)
        if backend == "zmq":  # each rank's row socket checks the grant like any: another transfer's is refused
            with pytest.raises(ValueError, match="not reserved"):
                sender.write(msgspec.structs.replace(target, grant="other"), blocks, rows)
        # one layer's planes of some rows, from a row inside the run (a prefill sending layer by layer)
        layer = torch.randn(3, 2, 4 * DIM)
        if not sender.writes_layers:
            with pytest.raises(ValueError, match="whole rows"):
                sender.write(target, blocks, layer, 2, 2)
        else:
            assert sender.write(target, blocks, layer, 2, 2) == layer.numel() * 4
            expected = rows.clone().view(7, PARTS, -1)
            expected[2:5, 2:4] = layer
            assert torch.equal(kv.read_rows(blocks, 0, 7), expected.view(7, -1))
            with pytest.raises(ValueError, match="do not fit"):  # past the run, or past the planes
                sender.write(target, blocks, layer, 2 * BLOCK_TOKENS - 2, 2)
            with pytest.raises(ValueError, match="do not fit"):
                sender.write(target, blocks, layer, 0, PARTS - 1)
    finally:
        sender.close()
        receiver.close()
        for s in kv.shards:
            s.unlink()


def _target(heads, part_widths, whole_heads=4, parts=PARTS):
    from vlserve.disagg.messages import RankTarget, TransferTarget
    from vlserve.engine.transfer_buffers import BufferLayout

    def lay(part_width):
        return BufferLayout("", BLOCKS, BLOCK_TOKENS, parts * part_width, "float32", parts)
    return TransferTarget("shm", lay(whole_heads * DIM), shards=[RankTarget(lay(w)) for w in part_widths],
                          heads=heads)


@pytest.mark.parametrize("case", ["a head missing", "a rank's heads past the last", "a file of the wrong width",
                                  "heads of another count", "no planes", "a width far past the rows'"])
def test_a_target_that_does_not_describe_whole_heads_is_refused(case):
    target = {
        "a head missing": _target([(0, 2), (1, 1)], [2 * DIM, DIM]),
        "a rank's heads past the last": _target([(0, 2), (3, 2)], [2 * DIM, 2 * DIM]),
        "a file of the wrong width": _target([(0, 2), (2, 2)], [2 * DIM, 3 * DIM]),
        "heads of another count": _target([(0, 2)], [2 * DIM, 2 * DIM]),
        "no planes": _target([(0, 2), (2, 2)], [2 * DIM, 2 * DIM], parts=0),
        # (before: a set of 2**40 heads built on the writer thread)
        "a width far past the rows'": _target([(0, 2**40)], [2**40 * DIM], whole_heads=2**40),
    }[case]
    if case not in ("no planes", "a width far past the rows'"):
        with pytest.raises(ValueError):
            check_shards(target)
    with pytest.raises(ValueError):  # nothing is mapped or written: the target is refused first
        ShmTransport().write(target, [0], whole_rows(2, 4))


def test_heads_cover_says_whether_every_head_is_kept():
    assert heads_cover([(0, 2), (2, 2)], 4) and heads_cover([(2, 2), (0, 2)], 4) and heads_cover([(0, 1)] * 3, 1)
    assert not heads_cover([(0, 2), (3, 1)], 4) and not heads_cover([(0, 4), (4, 1)], 4)
    assert not heads_cover([(0, 0), (0, 4)], 4) and not heads_cover([(-1, 2), (1, 3)], 4)
