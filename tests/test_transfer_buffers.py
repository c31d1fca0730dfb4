"""Receive blocks shared by a language front-end and its engine process: allocation on the engine's block pool,
writes and reads by row index over non-contiguous runs, a second process mapping the same memory, the
file name gone after unlink while mappings stay valid, and bounds checks on every address."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from vlserve.engine.transfer_buffers import TransferBuffers

WIDTH = 6


def _scattered(buf: TransferBuffers, tokens: int) -> list[int]:
    """Blocks that are neither contiguous nor in order: fill the pool, free every other block backwards."""
    every = [buf.allocate(buf.block_tokens) for _ in range(buf.num_blocks)]
    buf.free([b[0] for b in every[::2]][::-1])
    ids = buf.allocate(tokens)
    assert any(y - x != 1 for x, y in zip(ids, ids[1:]))
    return ids


def test_allocation_is_all_or_nothing_and_checked():
    buf = TransferBuffers.create(4, 4, WIDTH, torch.float32, shared=False)
    assert buf.blocks_for(0) == 1 and buf.blocks_for(9) == 3
    a = buf.allocate(12)
    assert len(a) == 3 and buf.num_free == 1
    assert buf.allocate(8) is None and buf.num_free == 1  # nothing taken when short
    with pytest.raises(ValueError):
        buf.allocate(100)  # never fits
    buf.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        buf.free(a)
    buf.check_integrity()
    assert buf.num_free == 4


@pytest.mark.parametrize("parts", [1, 2])
def test_rows_round_trip_over_scattered_runs(parts):
    buf = TransferBuffers.create(8, 4, WIDTH, torch.bfloat16, shared=False, parts=parts)
    ids = _scattered(buf, 10)
    where = torch.tensor([3, 4, 5, 8])
    rows = torch.randn(4, WIDTH)
    buf.write_rows(ids, where, rows)
    assert torch.equal(buf.read_rows(ids, 3, 3), rows[:3].to(torch.bfloat16))  # across a block edge
    assert torch.equal(buf.read_rows(ids, 8, 1, columns=2), rows[3:, :2].to(torch.bfloat16))
    assert buf.rows_finite(ids, where)
    buf.write_rows(ids, torch.tensor([9]), torch.full((1, WIDTH), float("nan")))
    assert buf.rows_finite(ids, where) and not buf.rows_finite(ids, torch.tensor([8, 9]))
    assert buf.layout.nbytes < 8 * 4 * (WIDTH * 2 + 4 * 8)  # rows only: token ids and positions travel beside


@pytest.mark.parametrize("bad", [
    lambda b, ids: b.write_rows(ids, torch.tensor([12]), torch.zeros(1, WIDTH)),  # past the run
    lambda b, ids: b.write_rows(ids, torch.tensor([-1]), torch.zeros(1, WIDTH)),
    lambda b, ids: b.write_rows(ids, torch.tensor([1]), torch.zeros(1, WIDTH + 1)),  # wrong width
    lambda b, ids: b.write_rows([99], torch.tensor([0]), torch.zeros(1, WIDTH)),  # no such block
    lambda b, ids: b.read_rows(ids, 10, 3),  # runs past the run
    lambda b, ids: b.read_rows([], 0, 1),
])
def test_every_address_is_checked(bad):
    buf = TransferBuffers.create(4, 4, WIDTH, torch.float32, shared=False)
    ids = buf.allocate(12)
    with pytest.raises(ValueError):
        bad(buf, ids)


def _reader(layout, ids, queue):
    other = TransferBuffers.attach(layout)
    queue.put(other.read_rows(ids, 0, 2).tolist())
    other.write_rows(ids, torch.tensor([5]), torch.full((1, WIDTH), 7.0))  # visible to the owner


def test_another_process_maps_the_same_memory_even_after_unlink():
    buf = TransferBuffers.create(4, 4, WIDTH, torch.float32)
    try:
        ids = buf.allocate(8)
        buf.write_rows(ids, torch.tensor([0, 1]), torch.tensor([[1.0] * WIDTH, [2.0] * WIDTH]))
        queue = multiprocessing.get_context("spawn").Queue()
        proc = multiprocessing.get_context("spawn").Process(target=_reader, args=(buf.layout, ids, queue))
        proc.start()
        assert queue.get(timeout=60) == [[1.0] * WIDTH, [2.0] * WIDTH]
        proc.join(60)
        assert proc.exitcode == 0
        assert buf.read_rows(ids, 5, 1).tolist() == [[7.0] * WIDTH]
    finally:
        buf.unlink()
    assert not os.path.exists(buf.layout.path)
    assert buf.read_rows(ids, 0, 1).tolist() == [[1.0] * WIDTH]  # the mapping outlives the name


def test_a_reserved_buffer_too_big_for_its_folder_is_a_clear_error(monkeypatch):
    """A KV cache in shared memory takes its pages at start: a folder too small (a container's 64 MiB /dev/shm)
    is refused then, with what to do, and leaves no file behind (not a SIGBUS mid-request)."""
    import os
    import tempfile

    import vlserve.engine.transfer_buffers as tb
    from vlserve.core.errors import ConfigurationError

    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    folder = tb.shm_dir() or tempfile.gettempdir()
    ours = f"{tb.TRANSFER_FILE_PREFIX}{os.getpid()}-"  # (other test workers make files there too)
    before = {n for n in os.listdir(folder) if n.startswith(ours)}
    with pytest.raises(ConfigurationError, match="--shm-size"):
        TransferBuffers.create(8, 4, WIDTH, torch.float32, parts=2, reserve=True)
    assert {n for n in os.listdir(folder) if n.startswith(ours)} == before
    buf = TransferBuffers.create(8, 4, WIDTH, torch.float32, parts=2)  # not reserved: pages come when touched
    buf.unlink()
