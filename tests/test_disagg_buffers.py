"""Block pool for encode/language disaggregation: accounting, errors, scatter/gather round trips."""

from __future__ import annotations

import random

import pytest
import torch

from vlserve.disagg.buffers import BufferSpec, EmbeddingBuffers


def make(num_blocks=8, bt=4, hidden=6, dtype=torch.float32, extra=0, aux=4):
    return EmbeddingBuffers(BufferSpec(bt, hidden, dtype, extra_features=extra, aux_fields=aux), num_blocks)


def scattered_ids(buf: EmbeddingBuffers, num_tokens: int) -> list[int]:
    """Allocate so the returned ids are non-contiguous and out of order: fill the pool, free even ids backwards."""
    for _ in range(buf.num_free):
        buf.allocate(1)
    buf.free(list(range(0, buf.num_blocks, 2))[::-1])
    ids = buf.allocate(num_tokens)
    assert ids is not None
    assert any(y - x != 1 for x, y in zip(ids, ids[1:]))
    return ids


def random_rows(n: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, width, generator=g)
    ids = torch.randint(0, 50_000, (n,), generator=g)
    pos = torch.randint(0, 4096, (3, n), generator=g)
    return emb, ids, pos


def test_spec_validation():
    with pytest.raises(ValueError):
        BufferSpec(0, 4, torch.float32)
    with pytest.raises(ValueError):
        BufferSpec(4, 0, torch.float32)
    with pytest.raises(ValueError):
        BufferSpec(4, 4, torch.int64)
    with pytest.raises(ValueError):
        BufferSpec(4, 4, torch.float32, extra_features=-1)
    with pytest.raises(ValueError):
        EmbeddingBuffers(BufferSpec(4, 4, torch.float32), 0)


def test_shapes_and_blocks_for():
    buf = make(num_blocks=5, bt=4, hidden=6, extra=3, aux=2, dtype=torch.bfloat16)
    assert buf.embeddings.shape == (5, 4, 9) and buf.embeddings.dtype == torch.bfloat16
    assert buf.fill_ids.shape == (5, 4) and buf.fill_ids.dtype == torch.int64
    assert buf.positions.shape == (5, 3, 4) and buf.positions.dtype == torch.int64
    assert buf.aux.shape == (5, 2) and buf.aux.dtype == torch.int64
    assert [buf.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [1, 1, 1, 1, 2, 2, 3]


def test_allocate_free_accounting_all_or_nothing():
    buf = make(num_blocks=8, bt=4)
    assert (buf.num_blocks, buf.num_free, buf.num_used) == (8, 8, 0)
    a = buf.allocate(9)  # 3 blocks
    b = buf.allocate(16)  # 4 blocks
    assert len(a) == 3 and len(b) == 4 and not set(a) & set(b)
    assert (buf.num_free, buf.num_used) == (1, 7)
    assert buf.allocate(5) is None  # needs 2, only 1 free: nothing taken
    assert buf.num_free == 1
    c = buf.allocate(4)
    assert len(c) == 1 and buf.num_free == 0
    assert buf.allocate(1) is None
    buf.free(b)
    assert (buf.num_free, buf.num_used) == (4, 4)
    buf.free(a + c)
    assert (buf.num_free, buf.num_used) == (8, 0)
    buf.check_integrity()


def test_allocate_errors():
    buf = make(num_blocks=4, bt=4)
    with pytest.raises(ValueError):
        buf.allocate(0)
    with pytest.raises(ValueError):
        buf.allocate(-3)
    with pytest.raises(ValueError, match="pool"):
        buf.allocate(17)  # 5 blocks > whole pool
    assert buf.allocate(16) is not None  # exactly the pool is fine
    with pytest.raises(ValueError):
        buf.allocate(17)  # still an error (not None) when the pool is full


def test_free_errors_leave_state_untouched():
    buf = make(num_blocks=4, bt=4)
    ids = buf.allocate(8)
    with pytest.raises(ValueError):
        buf.free([ids[0], 99])  # unknown id
    with pytest.raises(ValueError):
        buf.free([ids[0], -1])
    with pytest.raises(ValueError):
        buf.free([ids[0], ids[1], ids[0]])  # duplicate in call
    assert buf.num_used == 2  # none of the failed calls freed anything
    buf.free([ids[0]])
    with pytest.raises(ValueError, match="double free"):
        buf.free([ids[1], ids[0]])
    assert buf.num_used == 1
    buf.check_integrity()


@pytest.mark.parametrize("extra", [0, 3])
def test_scatter_gather_round_trip_float32(extra):
    buf = make(num_blocks=10, bt=4, hidden=6, extra=extra)
    total = 17  # 5 blocks, last partly used
    ids = scattered_ids(buf, total)
    emb, fid, pos = random_rows(total, 6 + extra, seed=1)
    # Several chunks, some crossing block boundaries, one empty.
    bounds = [0, 3, 3, 9, 10, 17]
    for s, e in zip(bounds, bounds[1:]):
        buf.scatter(ids, s, emb[s:e], fid[s:e], pos[:, s:e])
    g_emb, g_fid, g_pos = buf.gather(ids, 0, total)
    assert torch.equal(g_emb, emb) and torch.equal(g_fid, fid) and torch.equal(g_pos, pos)
    for s, n in [(0, 1), (2, 7), (4, 4), (5, 12), (16, 1), (7, 0)]:
        g_emb, g_fid, g_pos = buf.gather(ids, s, n)
        assert g_emb.shape == (n, 6 + extra) and g_pos.shape == (3, n)
        assert torch.equal(g_emb, emb[s:s + n])
        assert torch.equal(g_fid, fid[s:s + n])
        assert torch.equal(g_pos, pos[:, s:s + n])
    if extra:
        assert torch.equal(buf.gather(ids, 0, total)[0][:, 6:], emb[:, 6:])
    # Token i must live in block ids[i // bt], row i % bt.
    for i in (0, 5, 16):
        assert torch.equal(buf.embeddings[ids[i // 4], i % 4], emb[i])
        assert torch.equal(buf.positions[ids[i // 4], :, i % 4], pos[:, i])


def test_gather_returns_copies():
    buf = make()
    ids = buf.allocate(6)
    emb, fid, pos = random_rows(6, 6, seed=2)
    buf.scatter(ids, 0, emb, fid, pos)
    g_emb, g_fid, g_pos = buf.gather(ids, 0, 6)
    g_emb.zero_(), g_fid.zero_(), g_pos.zero_()
    again = buf.gather(ids, 0, 6)
    assert torch.equal(again[0], emb) and torch.equal(again[1], fid) and torch.equal(again[2], pos)


def test_scatter_gather_bf16_with_extra():
    buf = make(num_blocks=12, bt=5, hidden=8, extra=4, dtype=torch.bfloat16)
    total = 23
    ids = scattered_ids(buf, total)
    emb, fid, pos = random_rows(total, 12, seed=3)
    for s, e in [(0, 7), (7, 15), (15, 23)]:
        buf.scatter(ids, s, emb[s:e], fid[s:e], pos[:, s:e])
    g_emb, g_fid, g_pos = buf.gather(ids, 0, total)
    assert g_emb.dtype == torch.bfloat16
    assert torch.equal(g_emb, emb.to(torch.bfloat16))
    assert torch.equal(g_emb[:, 8:], emb[:, 8:].to(torch.bfloat16))
    assert torch.equal(g_fid, fid) and torch.equal(g_pos, pos)


def test_scatter_errors():
    buf = make(num_blocks=8, bt=4, hidden=6)
    ids = buf.allocate(7)  # 2 blocks -> capacity 8 tokens
    emb, fid, pos = random_rows(3, 6, seed=4)
    buf.scatter(ids, 5, emb, fid, pos)  # exactly fills capacity
    with pytest.raises(ValueError, match="past"):
        buf.scatter(ids, 6, emb, fid, pos)
    with pytest.raises(ValueError, match="past"):
        buf.gather(ids, 6, 3)
    with pytest.raises(ValueError):
        buf.scatter(ids, 0, emb[:, :5], fid, pos)  # wrong width
    with pytest.raises(ValueError):
        buf.scatter(ids, 0, emb, fid[:2], pos)
    with pytest.raises(ValueError):
        buf.scatter(ids, 0, emb, fid, pos[:2])
    with pytest.raises(ValueError):
        buf.scatter(ids, -1, emb, fid, pos)
    with pytest.raises(ValueError):
        buf.scatter([ids[0], ids[0]], 0, emb, fid, pos)  # aliased blocks
    free_id = next(b for b in range(8) if b not in ids)
    with pytest.raises(ValueError, match="not allocated"):
        buf.scatter([free_id], 0, emb, fid, pos)


def test_aux_round_trip():
    buf = make(num_blocks=8, bt=4, aux=3)
    a = scattered_ids(buf, 9)
    b = buf.allocate(4)
    buf.write_aux(a, [1234, -7, 2**40])
    buf.write_aux(b, [1, 2, 3])
    assert buf.read_aux(a) == [1234, -7, 2**40]
    assert buf.read_aux(b) == [1, 2, 3]
    assert buf.aux[a[0]].tolist() == [1234, -7, 2**40]
    with pytest.raises(ValueError):
        buf.write_aux(a, [1, 2])
    with pytest.raises(ValueError):
        buf.read_aux([])


def test_random_alloc_free_integrity():
    rng = random.Random(1234)
    buf = make(num_blocks=32, bt=4)
    live: list[list[int]] = []
    for _ in range(1000):
        if live and rng.random() < 0.45:
            buf.free(live.pop(rng.randrange(len(live))))
        else:
            ids = buf.allocate(rng.randint(1, 40))
            if ids is not None:
                live.append(ids)
        assert buf.num_used == sum(map(len, live))
        assert buf.num_free + buf.num_used == 32
        buf.check_integrity()
    for ids in live:
        buf.free(ids)
    assert (buf.num_free, buf.num_used) == (32, 0)
    buf.check_integrity()


def test_check_integrity_detects_corruption():
    buf = make(num_blocks=4)
    ids = buf.allocate(4)
    buf.allocated.discard(ids[0])  # block now in neither set
    with pytest.raises(RuntimeError):
        buf.check_integrity()
