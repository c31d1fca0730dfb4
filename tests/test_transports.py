"""Each transport on its own: a chunk's rows sent over a real connection land in the receiver's blocks exactly as
the copying reference puts them there, its token ids and positions come back beside them; shared memory maps
nothing but a vlserve buffer file; a backend mismatch or a malformed chunk is a clear error."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from tests.test_disagg import BACKENDS
from vlserve.disagg.messages import TransferTarget
from vlserve.core.errors import ConfigurationError
from vlserve.disagg.transports.base import (
    DEFAULT_QUARANTINE_S,
    QUARANTINE_ENV,
    quarantine_s,
    write_run,
    write_timeout_s,
)
from vlserve.disagg.transports.loopback import Loopback, media_chunk
from vlserve.core.private_dirs import HALF_MADE_AGE_S
from vlserve.engine.transfer_buffers import TRANSFER_FILE_PREFIX, TransferBuffers, slot_runs

WIDTH, BLOCK_TOKENS = 48, 16
GRANT = "7:the-receivers-secret-name:r1"


def write_chunk(buffers: TransferBuffers, header, data) -> None:
    """The copying reference: the chunk's rows into the run, from its first slot."""
    if data.rows.numel():
        write_run(buffers, header.block_ids, data.rows)


def _buffers(dtype=torch.float32, parts: int = 1) -> TransferBuffers:
    return TransferBuffers.create(64, BLOCK_TOKENS, WIDTH, dtype, parts=parts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,parts", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 6)])
def test_a_chunk_lands_where_the_reference_puts_it(backend, dtype, parts):
    """`parts` 6: rows stored plane by plane, as in a decode engine's KV cache."""
    got, want = _buffers(dtype, parts), TransferBuffers.create(64, BLOCK_TOKENS, WIDTH, dtype, shared=False)
    link = Loopback(backend, got)

    async def go():
        await link.connect()
        # Blocks out of order, a run that ends mid-block, rows spanning block edges, sent as float32.
        for seed, (blocks, n, media) in enumerate([([7, 3, 40], 40, (5, 37)), ([9], 16, (0, 16)),
                                                   ([1, 2], 20, (19, 20)), ([11], 4, (0, 0))]):
            header, data = media_chunk(blocks, BLOCK_TOKENS, n, media, WIDTH, torch.float32, seed)
            tokens = await link.transfer(header, data)
            assert tokens.nbytes > 0
            assert torch.equal(tokens.fill_ids, data.fill_ids) and torch.equal(tokens.positions, data.positions)
            write_chunk(want, header, data)

    try:
        asyncio.run(go())
    finally:
        link.close()
        got.unlink()
    everything, slots = list(range(64)), 64 * BLOCK_TOKENS
    assert torch.equal(got.read_rows(everything, 0, slots), want.read_rows(everything, 0, slots))
    assert torch.equal(got.read_rows([1, 2], 0, 1), want.read_rows([1, 2], 0, 1))  # the one row of token 19
    if parts > 1:  # each piece of a row in its own plane, at the row's slot
        row = want.read_rows([7], 0, 1).view(parts, -1)
        assert torch.equal(got.planes[:, 7 * BLOCK_TOKENS], row)


def test_shm_maps_only_vlserve_buffer_files(tmp_path):
    buffers = _buffers()
    link = Loopback("shm", buffers)
    header, data = media_chunk([0], BLOCK_TOKENS, 4, (0, 2), WIDTH)
    bad_targets = {
        "another file": TransferTarget("shm", msgspec_replace(link.target.layout, path=str(tmp_path / "x"))),
        "not on this host": TransferTarget("shm", msgspec_replace(
            link.target.layout, path=os.path.join(os.path.dirname(buffers.layout.path), TRANSFER_FILE_PREFIX + "gone"))),
        "wrong size": TransferTarget("shm", msgspec_replace(link.target.layout, num_blocks=65)),
        "another backend": TransferTarget("mooncake", link.target.layout),
    }
    messages = {"another file": "not a vlserve transfer file", "not on this host": "not on this host",
                "wrong size": "its layout says", "another backend": "same backend"}

    async def go():
        await link.connect()
        for name, target in bad_targets.items():
            with pytest.raises(ValueError, match=messages[name]):
                await link.sender.send(link.router, link.peer, header, data, target)
        with pytest.raises(ValueError, match="same backend"):
            await link.sender.send(link.router, link.peer, header, data, None)

    try:
        asyncio.run(go())
        with pytest.raises(ValueError, match="must not carry them as frames"):
            asyncio.run(link.receiver.receive(header, [b"", b"x", b"y", b"z"], buffers))
        with pytest.raises(ValueError, match="fill ids and positions as frames"):
            asyncio.run(link.receiver.receive(header, [b""], buffers))
    finally:
        link.close()
        buffers.unlink()


@pytest.mark.parametrize("parts", [1, 4])
def test_remote_writes_stay_inside_the_receivers_blocks(parts):
    from vlserve.disagg.transports.remote_write import StagedWrites

    buffers = _buffers(parts=parts)
    target = TransferTarget("mooncake", buffers.layout, "peer", 1 << 40)
    staged = StagedWrites(lambda region: None, lambda region: None)
    for bad in ([10**9], [-5], [3, 64]):
        header, data = media_chunk(bad, BLOCK_TOKENS, 4, (0, 2), WIDTH)
        with pytest.raises(ValueError, match="outside the receiver"):
            staged.plan(header.block_ids, data.rows, target)
    header, data = media_chunk([3], BLOCK_TOKENS, 40, (0, 40), WIDTH)
    with pytest.raises(ValueError, match="do not fit"):  # more rows than the run's slots
        staged.plan(header.block_ids, data.rows, target)
    header, data = media_chunk([63, 0], BLOCK_TOKENS, 20, (0, 20), WIDTH)
    src, dst, lengths = staged.plan(header.block_ids, data.rows, target)
    assert all(target.base_address <= d and d + n <= target.base_address + buffers.layout.nbytes
               for d, n in zip(dst, lengths))
    buffers.unlink()


def test_shm_refuses_a_symlink(tmp_path):
    buffers = _buffers()
    folder = os.path.dirname(buffers.layout.path)
    link = os.path.join(folder, TRANSFER_FILE_PREFIX + "link-test")
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * buffers.layout.nbytes)
    os.symlink(victim, link)
    shm = Loopback("shm", buffers)
    try:
        target = TransferTarget("shm", msgspec_replace(buffers.layout, path=link))
        with pytest.raises(ValueError, match="refusing to map"):
            shm.sender._buffers(target)
    finally:
        os.unlink(link)
        shm.close()
        buffers.unlink()


def test_zmq_refuses_rows_that_do_not_match_the_segments():
    buffers = _buffers()
    link = Loopback("zmq", buffers)
    header, data = media_chunk([0, 1], BLOCK_TOKENS, 20, (2, 10), WIDTH)
    data.rows = data.rows[:5]

    async def go():
        await link.connect()
        with pytest.raises(ValueError, match="segments name 8 embedding rows"):
            await link.transfer(header, data)

    try:
        asyncio.run(go())
    finally:
        link.close()
        buffers.unlink()


def test_stale_buffer_files_are_swept_and_live_ones_kept(tmp_path):
    """A file whose owner still holds its lock stays (whatever its pid says); an unlocked one goes. A hidden one (made,
    not yet locked and named: CI once lost one to a sweep in that gap) stays while it is young, and goes when old."""
    import fcntl

    dead = tmp_path / f"{TRANSFER_FILE_PREFIX}1-abc"
    alive = tmp_path / f"{TRANSFER_FILE_PREFIX}1-def"
    other = tmp_path / "unrelated-1-abc"
    being_made = tmp_path / f".{TRANSFER_FILE_PREFIX}1-ghi"
    abandoned = tmp_path / f".{TRANSFER_FILE_PREFIX}1-jkl"
    for f in (dead, alive, other, being_made, abandoned):
        f.write_bytes(b"x")
    old = time.time() - HALF_MADE_AGE_S - 5
    os.utime(abandoned, (old, old))
    owner = os.open(alive, os.O_RDONLY)
    fcntl.flock(owner, fcntl.LOCK_EX)
    child = __import__("subprocess").run(  # another process sweeps, as a restarted server would
        [__import__("sys").executable, "-c", f"from vlserve.engine.transfer_buffers import sweep_stale_files; "
                                             f"sweep_stale_files({str(tmp_path)!r})"], check=True)
    os.close(owner)
    assert child.returncode == 0
    assert not dead.exists() and alive.exists() and other.exists()
    assert being_made.exists() and not abandoned.exists()


def test_remote_writes_coalesce_consecutive_slots():
    assert slot_runs(torch.tensor([4, 5, 6, 20, 21, 3])) == [(0, 4, 3), (3, 20, 2), (5, 3, 1)]
    assert slot_runs(torch.tensor([], dtype=torch.int64)) == []


def msgspec_replace(layout, **changes):
    import msgspec

    return msgspec.structs.replace(layout, **changes)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_copies_into_the_blocks_run_off_the_event_loop(backend, monkeypatch):
    """The copy that grows with a chunk (~100 MiB of KV for a 7B model) never runs on the event loop: on the
    receiver for ZeroMQ (it copies the frames), on the sender for shared memory (it writes the mapped file)."""
    buffers = _buffers()
    link = Loopback(backend, buffers)
    threads = []
    write_rows = TransferBuffers.write_rows

    def spy(self, *args):
        threads.append(threading.current_thread())
        return write_rows(self, *args)

    monkeypatch.setattr(TransferBuffers, "write_rows", spy)

    async def go():
        await link.connect()
        header, data = media_chunk([3, 4], BLOCK_TOKENS, 20, (2, 18), WIDTH)
        await link.transfer(header, data)

    try:
        asyncio.run(go())
    finally:
        link.close()
        buffers.unlink()
    assert threads and threading.main_thread() not in threads


def test_a_cancelled_copy_is_waited_for_before_the_caller_goes_on():
    """Cancelling whoever waits for a copy (a client that disconnects) must not let its blocks be freed while a
    worker thread still writes into them: the cancellation takes effect once the copy has ended."""
    from vlserve.disagg.transports.base import in_thread

    started, release = threading.Event(), threading.Event()
    log = []

    def copy():
        started.set()
        release.wait(10)
        log.append("copied")

    async def go():
        task = asyncio.ensure_future(in_thread(copy))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.2)
        task.cancel()  # twice: still waits
        await asyncio.sleep(0.2)
        assert not task.done(), "the caller went on while the copy was still writing"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        log.append("caller done")

    asyncio.run(go())
    assert log == ["copied", "caller done"]


def test_the_quarantine_is_configurable_and_writes_give_up_before_it(monkeypatch):
    monkeypatch.delenv(QUARANTINE_ENV, raising=False)
    assert quarantine_s() == DEFAULT_QUARANTINE_S and write_timeout_s() < quarantine_s()
    monkeypatch.setenv(QUARANTINE_ENV, "6")
    assert quarantine_s() == 6.0 and write_timeout_s() == 4.0
    for bad in ("0.5", "soon", "nan", "inf", "-3"):
        monkeypatch.setenv(QUARANTINE_ENV, bad)
        with pytest.raises(ConfigurationError, match=QUARANTINE_ENV):
            quarantine_s()


# ---- ZeroMQ's row socket -------------------------------------------------------------------------------------
def _zmq_pair(monkeypatch, receiver_secret=None, sender_secret=None):
    from vlserve.disagg.transports.zmq import ZmqTransport

    monkeypatch.setenv(QUARANTINE_ENV, "1.5")  # writes give up after 1 s
    buffers = _buffers()
    receiver, sender = ZmqTransport(secret=receiver_secret), ZmqTransport(secret=sender_secret)
    # One transfer holds blocks 0-15 (what its receiver reserved and sends the sender with the request)
    buffers.grants.open(GRANT, range(16))
    return buffers, receiver, sender, msgspec_replace(receiver.target(buffers), grant=GRANT)


def _raw_write(address: str, frames: list) -> bytes:
    """What the row socket answers a hand-made message (None: no answer within 2 s)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        return sock.recv() if sock.poll(2000) else None
    finally:
        sock.close(0)


def test_zmq_rows_land_through_the_row_socket_and_bad_writes_are_refused(monkeypatch):
    """A write lands (answered once it has), with the secret over CurveZMQ; a write outside the blocks, of the
    wrong size, malformed or arriving after its sender gave up (by the receiver's clock) is refused with nothing
    written, and the socket keeps serving."""
    import msgspec

    from vlserve.disagg.transports.zmq import RowWrite, RowWritten

    buffers, receiver, sender, target = _zmq_pair(monkeypatch, "s3cret", "s3cret")
    rows = torch.randn(20, WIDTH)
    try:
        assert target.backend == "zmq" and target.session.startswith("ipc://")  # loopback: a Unix socket
        assert sender.write_rows(target, [5, 2], rows) == rows.numel() * 4
        assert torch.equal(buffers.read_rows([5, 2], 0, 20), rows)
        with pytest.raises(ValueError, match="outside the receiver's 64 blocks"):
            sender.write_rows(msgspec.structs.replace(target, layout=msgspec.structs.replace(
                target.layout, num_blocks=1000)), [999], rows[:4])
        before = buffers.read_rows(list(range(64)), 0, 64 * BLOCK_TOKENS).clone()
        assert _raw_write(target.session, [b"x", b"y"]) is None  # no secret: no handshake, no answer
        late = RowWrite(7, GRANT, [9], 4, sent_at=time.time() - 0.9)  # gives up after 1 s, less a 0.25 s margin
        short = RowWrite(8, GRANT, [9], 4, sent_at=time.time())
        for header, data, why in [(late, rows[:4], "came too late"),
                                  (short, rows[:3], "need 768 bytes, the write has 576")]:
            answer = _secure_write(target.session, [msgspec.msgpack.encode(header), rows_bytes(data)])
            reply = msgspec.msgpack.decode(answer, type=RowWritten)
            assert reply.write_id == header.write_id and why in reply.error
        garbage = msgspec.msgpack.decode(_secure_write(target.session, [b"\xc1junk", b""]), type=RowWritten)
        one_frame = msgspec.msgpack.decode(_secure_write(target.session, [b"alone"]), type=RowWritten)
        assert garbage.error and "got 1 frames" in one_frame.error
        assert torch.equal(buffers.read_rows(list(range(64)), 0, 64 * BLOCK_TOKENS), before)  # nothing written
        assert sender.write_rows(target, [9], rows[:4]) > 0  # and it still serves
        assert torch.equal(buffers.read_rows([9], 0, 4), rows[:4])
    finally:
        sender.close()
        receiver.close()
        buffers.unlink()


def test_zmq_a_decode_engines_row_socket_refuses_rows_that_are_not_finite(monkeypatch):
    """#67: a decode engine's row socket copies each write into its KV cache, so it checks the rows first
    (`check_finite`, for a model whose every KV row is a value) and refuses NaN or inf with nothing written: the
    prefill's transfer fails and is retried elsewhere, and the engine need not read them again. Without it (a
    hybrid model: its state rows are float32 bytes that may read as NaN in the KV dtype) they land as any bytes,
    for the engine to judge. The other backends write one-sided: nothing to refuse with."""
    from vlserve.disagg.transports.row_writer import TransportKVReceiver, decode_target
    from vlserve.disagg.transports.zmq import ZmqTransport

    monkeypatch.setenv(QUARANTINE_ENV, "1.5")
    # Finite float32 states whose low halves (0x7fc1) read as bf16 NaN
    states = torch.full((4, WIDTH // 2), 0x3F807FC1, dtype=torch.int32).view(torch.float32)
    assert states.isfinite().all() and states.view(torch.bfloat16).isnan().any()
    nan, inf = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    nan[2, 7], inf[0, 0] = float("nan"), float("-inf")
    sender = ZmqTransport()
    try:
        for check_finite in (True, False):
            buffers = _buffers(torch.bfloat16, parts=6)  # laid out as a decode engine's KV cache
            buffers.grants.open(GRANT, range(16))
            receiver = TransportKVReceiver("zmq", "127.0.0.1", None, buffers, check_finite=check_finite)
            try:
                assert receiver.rows_checked is check_finite
                target = msgspec_replace(decode_target(receiver.target), grant=GRANT)
                rows = torch.randn(20, WIDTH)
                sender.write_rows(target, [5, 2], rows)
                assert torch.equal(buffers.read_rows([5, 2], 0, 20), rows.to(torch.bfloat16))
                for bad in (nan, inf, states.view(torch.bfloat16)):
                    before = buffers.storage.clone()
                    if check_finite:
                        with pytest.raises(ValueError, match="NaN or infinite values: nothing written"):
                            sender.write_rows(target, [9], bad)
                        assert torch.equal(buffers.storage, before)
                    else:
                        sender.write_rows(target, [9], bad)
                        assert torch.equal(buffers.read_rows([9], 0, 4).view(torch.int16),
                                           bad.to(torch.bfloat16).view(torch.int16))
            finally:
                receiver.close()
                buffers.unlink()
    finally:
        sender.close()
    buffers = _buffers()
    try:
        shm = TransportKVReceiver("shm", "127.0.0.1", None, buffers, check_finite=True)
        assert not shm.rows_checked  # one-sided: the engine checks at admission
        shm.close()
    finally:
        buffers.unlink()


def rows_bytes(rows: torch.Tensor) -> bytes:
    return rows.contiguous().view(torch.uint8).numpy().tobytes()


def _secure_write(address: str, frames: list) -> bytes:
    """A hand-made message over CurveZMQ with the test's secret."""
    import zmq

    from vlserve.disagg.auth import PeerAuth

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    PeerAuth("s3cret").secure_client(sock)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "the row socket did not answer"
        return sock.recv()
    finally:
        sock.close(0)


def test_zmq_a_sender_without_the_secret_writes_nothing(monkeypatch):
    buffers, receiver, sender, target = _zmq_pair(monkeypatch, "s3cret", "another")
    try:
        with pytest.raises(ConnectionError, match="cannot be reached"):  # no handshake without the secret
            sender.write_rows(target, [3], torch.ones(4, WIDTH))
        assert not buffers.read_rows([3], 0, 4).any()
    finally:
        sender.close()
        receiver.close()
        buffers.unlink()


def test_zmq_the_row_socket_listens_off_loopback_only_with_the_secret():
    """An address other than loopback (maybe a name, or translated on the way) is served on every interface:
    only with --disagg-secret, which the socket then requires."""
    from vlserve.disagg.transports import zmq as zmq_transport

    buffers = _buffers()
    try:
        with pytest.raises(ConfigurationError, match="without --disagg-secret"):
            zmq_transport.ZmqTransport("pod-a.example").target(buffers)
        secured = zmq_transport.ZmqTransport("pod-a.example", secret="s3cret")
        target = secured.target(buffers)
        assert target.session.startswith("tcp://pod-a.example:")  # peers reach it by the name it was given
        assert secured._servers[0].sock.getsockopt_string(zmq_transport.zmq.LAST_ENDPOINT).startswith("tcp://0.0.0.0:")
        secured.close()
    finally:
        buffers.unlink()
