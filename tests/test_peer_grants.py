"""A peer's word is checked against what this instance granted (issue #78): a zmq row socket takes a write only into
blocks reserved for that write's transfer (its grant), judges lateness by its own clock and answers every refusal,
an oversized header too; the roles refuse to start without the deployment's secret, and a local user without it
(uid 65534, forked from this root process) reaches neither a data channel nor a row socket: nothing lands."""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import signal
import threading
import time

import msgspec
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from tests.server_utils import free_port
from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.wire import Framer
from vlserve.disagg.auth import PeerAuth
from vlserve.disagg.messages import Ping, Pong, ReceiverToSender, TransferRequest
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.sender import SenderService
from vlserve.disagg.transports.base import QUARANTINE_ENV, HeadersOnly
from vlserve.disagg.transports.zmq import RowWrite, RowWritten, ZmqTransport
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.engine.write_grants import WriteGrants

SECRET, NOBODY = "s3cret", 65534
BLOCK, WIDTH = 16, 48
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a child as another user")


def as_nobody(fn, timeout: float = 60.0):
    """`fn()` in a child forked from this process, running as uid and gid 65534 without groups: what it returns
    (picklable); an exception there fails the test here."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's sockets or threads is used here
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = ("error", f"{type(e).__name__}: {e}")
        try:
            os.write(w, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(w)
    try:
        data, deadline = b"", time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert data, f"the child as uid {NOBODY} did not finish within {timeout:.0f}s"
    kind, value = pickle.loads(data)
    assert kind == "ok", f"as uid {NOBODY}: {value}"
    return value


def ask_unsecured(address: str, frames: list[bytes], wait_s: float = 2.0) -> bytes | None:
    """Send `frames` on a plain DEALER (no secret); the answer, or None. For a child: its own context."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        return sock.recv() if sock.poll(wait_s * 1000) else None
    finally:
        sock.close(0)
        ctx.term()


def ask_with_secret(address: str, frames: list[bytes]) -> RowWritten:
    """What the row socket answers a hand-made message over CurveZMQ with the secret (a rogue that holds it)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    PeerAuth(SECRET).secure_client(sock)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10000), "the row socket did not answer"
        return msgspec.msgpack.decode(sock.recv(), type=RowWritten)
    finally:
        sock.close(0)


def rows_bytes(n: int) -> bytes:
    return torch.full((n, WIDTH), 7.0).view(torch.uint8).numpy().tobytes()


# ---- the grants ----------------------------------------------------------------------------------------------------
def test_a_write_lands_only_in_its_grants_blocks_and_closing_waits_for_one_under_way():
    grants = WriteGrants()
    grants.open("t1", [3, 4])
    grants.open("t2", [5])
    for grant, blocks in (("t1", [3, 5]), ("t2", [3]), ("", [3]), ("t1", []), ("t3", [6])):
        with pytest.raises(ValueError, match="not reserved for its transfer"):
            with grants.writing(grant, blocks):
                pass
    writing, closed = threading.Event(), threading.Event()
    release = threading.Event()

    def write():
        with grants.writing("t1", [3, 4]):
            writing.set()
            release.wait(10)

    def close():
        grants.close([4])
        closed.set()

    threads = [threading.Thread(target=write), threading.Thread(target=close)]
    threads[0].start()
    assert writing.wait(10)
    threads[1].start()
    assert not closed.wait(0.3), "a block was let go while a write into it was under way"
    release.set()
    assert closed.wait(10)
    for t in threads:
        t.join()
    with pytest.raises(ValueError):  # block 4 is closed; t1 still writes into 3
        with grants.writing("t1", [3, 4]):
            pass
    with grants.writing("t1", [3]):
        pass
    grants.open("t2", [7])
    grants.open("t1", [7])  # given to another transfer: closing its old grant leaves it open to the new one
    grants.close_grant("t2")
    with grants.writing("t1", [3, 7]):
        pass
    grants.close_grant("t1")
    assert len(grants) == 0


# ---- the row socket ------------------------------------------------------------------------------------------------
@pytest.fixture
def row_socket(monkeypatch):
    """A receiver's buffers (64 blocks) behind its row socket with the secret; blocks 0-7 reserved for transfer
    "t1" (what the receiver sends its chosen peer), blocks 8-11 reserved for "t2" and already released."""
    monkeypatch.setenv(QUARANTINE_ENV, "6")  # writes give up after 4 s
    buffers = TransferBuffers.create(64, BLOCK, WIDTH, torch.float32, shared=False)
    receiver, sender = ZmqTransport(secret=SECRET), ZmqTransport(secret=SECRET)
    target = receiver.target(buffers)
    buffers.grants.open("t1", range(8))
    buffers.grants.open("t2", range(8, 12))
    buffers.grants.close_grant("t2")
    yield buffers, sender, target
    sender.close()
    receiver.close()


def test_a_row_socket_over_blocks_nobody_here_grants_takes_no_write():
    """Buffers whose blocks this process does not give out (mapped, no grants) took any write within them, for
    benchmarks; a row socket now takes writes only into blocks granted where it runs."""
    owner = TransferBuffers.create(8, BLOCK, WIDTH, torch.float32)
    mapped = TransferBuffers.attach(owner.layout)
    receiver, sender = ZmqTransport(), ZmqTransport()
    try:
        target = msgspec.structs.replace(receiver.target(mapped), grant="t1")
        with pytest.raises(ValueError, match="grants none of its blocks"):
            sender.write_rows(target, [0], torch.ones(BLOCK, WIDTH))
        assert not owner.storage.any()
        mapped.grants = WriteGrants()  # what its allocator (a decode engine's connector) sets up
        mapped.grants.open("t1", [0])
        sender.write_rows(target, [0], torch.ones(BLOCK, WIDTH))
        assert torch.equal(owner.read_rows([0], 0, BLOCK), torch.ones(BLOCK, WIDTH))
    finally:
        sender.close()
        receiver.close()
        owner.unlink()


def test_a_rogue_holding_the_secret_writes_nothing_outside_a_live_reservation(row_socket):
    """Before, the row socket took any write within its blocks (and a `not_after` of NaN passed the lateness
    check; a 5 MB header dropped the connection unanswered). Each one now gets an answer saying why, not a byte
    lands, and it goes on serving the transfer it granted."""
    buffers, sender, target = row_socket
    before = buffers.storage.clone()
    now = time.time()
    ungranted, not_now = "not reserved for its transfer", "is not a time of now"
    attempts = {  # (the write, why it is refused: the grant's checks run after the clock's)
        "unreserved blocks": (RowWrite(1, "t1", [40, 41], 2 * BLOCK, now), ungranted),
        "a run reaching past its reservation": (RowWrite(2, "t1", [7, 8], 2 * BLOCK, now), ungranted),
        "a guessed grant": (RowWrite(3, "t9", [0], BLOCK, now), ungranted),
        "no grant": (RowWrite(4, "", [0], BLOCK, now), ungranted),
        "a finished transfer": (RowWrite(5, "t2", [8], BLOCK, now), ungranted),
        "NaN for its send time": (RowWrite(6, "t1", [0], BLOCK, float("nan")), not_now),
        "inf for its send time": (RowWrite(7, "t1", [0], BLOCK, float("inf")), not_now),
        "a send time an hour ahead": (RowWrite(8, "t1", [0], BLOCK, now + 3600), not_now),
        "a send time long past": (RowWrite(9, "t1", [0], BLOCK, now - 3600), "came too late"),
    }
    for what, (header, why) in attempts.items():
        reply = ask_with_secret(target.session, [msgspec.msgpack.encode(header), rows_bytes(header.num_rows)])
        assert reply.write_id == header.write_id and why in reply.error, (what, reply.error)
    huge = msgspec.msgpack.encode(RowWrite(10, "t1", [0] * 1_000_000, BLOCK, now))
    assert len(huge) > 1_000_000
    reply = ask_with_secret(target.session, [huge, rows_bytes(BLOCK)])
    assert "header has" in reply.error and "nothing written" in reply.error
    five_mb = ask_with_secret(target.session, [b"\x00" * (5 * 2**20), rows_bytes(BLOCK)])
    assert "header has" in five_mb.error
    assert torch.equal(buffers.storage, before), "a refused write landed"

    granted = msgspec.structs.replace(target, grant="t1")  # the peer the receiver chose, with the grant it sent
    rows = torch.randn(3 * BLOCK, WIDTH)
    assert sender.write_rows(granted, [2, 0, 5], rows) == rows.numel() * 4
    assert torch.equal(buffers.read_rows([2, 0, 5], 0, 3 * BLOCK), rows)
    with pytest.raises(ValueError, match="not reserved for its transfer"):
        sender.write_rows(granted, [9], rows[:4])
    buffers.grants.close_grant("t1")  # its transfer is over
    with pytest.raises(ValueError, match="not reserved for its transfer"):
        sender.write_rows(granted, [2], rows[:4])
    assert torch.equal(buffers.read_rows([2, 0, 5], 0, 3 * BLOCK), rows)


@AS_ROOT
def test_a_local_user_without_the_secret_reaches_no_row_socket(row_socket):
    """Even knowing the grant and the socket's path: the folder is this user's alone, and CurveZMQ wants the
    secret."""
    buffers, _, target = row_socket
    before = buffers.storage.clone()
    path = target.session.removeprefix("ipc://")
    header = msgspec.msgpack.encode(RowWrite(1, "t1", [0], BLOCK, time.time()))

    def rogue():
        try:
            os.stat(path)
            reachable = True
        except PermissionError:
            reachable = False
        return reachable, ask_unsecured(target.session, [header, rows_bytes(BLOCK)])

    reachable, answer = as_nobody(rogue)
    assert not reachable and answer is None
    assert torch.equal(buffers.storage, before)


# ---- the data channel ------------------------------------------------------------------------------------------------
class _Sender(SenderService):
    """A sending role's data channel (a prefill instance's), recording the requests that reach it."""

    def __init__(self, secret: str):
        self.got: list = []
        self._setup("127.0.0.1", free_port(), PeerAuth(secret), HeadersOnly("zmq"),
                    TransferMetrics(CollectorRegistry(), None, "prefill", "kv"), 60.0)

    def pong(self, nonce: int) -> Pong:
        return Pong(nonce, 0, "arch", 8, 0)

    def on_request(self, peer: bytes, msg) -> None:
        self.got.append(msg)


@AS_ROOT
def test_a_local_user_without_the_secret_cannot_steer_a_prefill_instance(row_socket):
    """The issue's attack: uid 65534 sent a prefill instance a TransferRequest pointing at a decode instance's row
    socket. Now the instance has the secret (it refuses to start without), and the request never reaches it."""
    buffers, _, target = row_socket
    service = _Sender(SECRET)
    request = TransferRequest("rogue", 1, "hi", {}, {}, {}, list(range(32)), BLOCK,
                              msgspec.structs.replace(target, grant="t1"))
    frames = Framer(ReceiverToSender)

    async def go():
        service.bind()
        serving = asyncio.create_task(service.serve())
        try:
            address = f"tcp://127.0.0.1:{service.data_port}"
            answers = await asyncio.get_running_loop().run_in_executor(None, as_nobody, lambda: [
                ask_unsecured(address, frames.encode(msg)) for msg in (Ping(1), request)])
            assert answers == [None, None]
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            service.auth.stop()

    asyncio.run(go())
    assert service.got == []


@pytest.mark.parametrize("role", ["encode", "prefill", "language", "decode"])
def test_a_role_without_the_secret_refuses_to_start_on_loopback_too(role, monkeypatch):
    """Before, loopback was allowed with a warning ("only safe because it listens on loopback"): every user of the
    machine reaches a loopback port."""
    from vlserve.cli import main
    from vlserve.core.errors import EXIT_CONFIG
    from vlserve.disagg.remote_encoder import remote_prompt_encoder

    monkeypatch.delenv("VLSERVE_DISAGG_SECRET", raising=False)
    if role == "encode":
        records = []
        import logging

        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("vlserve").addHandler(handler)
        try:
            assert main(["encode", "--model", "/no/such/model", "--host", "127.0.0.1"]) == EXIT_CONFIG
        finally:
            logging.getLogger("vlserve").removeHandler(handler)
        assert any("VLSERVE_DISAGG_SECRET" in r.getMessage() for r in records)
        return
    with pytest.raises(InvalidInputError, match="--disagg-secret.*VLSERVE_DISAGG_SECRET"):
        remote_prompt_encoder(DisaggArgs(bootstrap="127.0.0.1:9"), "127.0.0.1:8000", "m", role)
    remote_prompt_encoder(DisaggArgs(bootstrap="127.0.0.1:9", disagg_secret=SECRET), "127.0.0.1:8000", "m", role)


def test_serve_disagg_gives_its_roles_a_secret_of_their_own_in_the_environment(monkeypatch):
    """The roles refuse to start without one, so `serve --disagg` makes one when the user gave none: the same for
    every child, never on a command line (which every local user can read), a new one for each deployment."""
    from vlserve.core.config import Options
    from vlserve.disagg import launcher

    started = []
    def run(self) -> int:  # what would start them; its state file goes as at a stop
        started.append(self.children)
        os.unlink(self.state_path)
        return 0

    monkeypatch.setattr(launcher.Supervisor, "run", run)
    monkeypatch.delenv("VLSERVE_DISAGG_SECRET", raising=False)
    secrets = set()
    for _ in range(2):
        opts = Options()
        opts.engine.model = "/m"
        opts.disagg.num_encoders, opts.disagg.num_prefill, opts.disagg.num_decode = 1, 1, 1
        assert launcher.run_roles(opts, "INFO") == 0
        children = started.pop()
        assert {c.name for c in children} == {"bootstrap", "encoder-0", "prefill-0", "decode-0"}
        given = {c.env.get("VLSERVE_DISAGG_SECRET") for c in children}
        assert len(given) == 1 and len(next(iter(given))) >= 32
        assert not any(next(iter(given)) in " ".join(c.argv) for c in children)
        secrets |= given
    assert len(secrets) == 2


def test_a_decode_engines_receive_blocks_take_writes_only_under_their_reservation(tiny_ckpt):
    """At several ranks or on a GPU a decode engine's prompts' KV lands in receive blocks, mapped by its engine
    process, whose row socket had nothing to check writes against but the layout (its front end allocated them).
    Now the engine reserves them per transfer as it does its KV cache: any other write is refused."""
    from tests.test_pd_handoff import PROMPTS, Prefill, _cfg, prefilled
    from vlserve.core.prompt import ProcessedPrompt
    from vlserve.core.sampling_params import SamplingParams
    from vlserve.core.wire import ReleaseKV, ReserveKV
    from vlserve.disagg.transports.row_writer import decode_target, kv_receiver_maker
    from vlserve.engine.core import EngineCore
    from vlserve.engine.kv_connector.decode import DecodeConnector

    cfg = _cfg(tiny_ckpt("qwen2_vl"), num_kv_blocks=64)
    width = cfg.model.kv_row_width
    front = TransferBuffers.create(16, BLOCK, width, cfg.dtype)  # the front end's file, mapped by the engine
    engine_side = TransferBuffers.attach(front.layout)
    core = EngineCore(cfg, report_released=True, transfer=engine_side, connector=DecodeConnector(cfg))
    receiver = kv_receiver_maker("zmq", "127.0.0.1", SECRET)(engine_side)
    writer = ZmqTransport(secret=SECRET)
    try:
        target = decode_target(receiver.target)
        blocks = core.connector.reserve(ReserveKV("t1", 0, 2 * BLOCK)).block_ids
        assert len(blocks) == 2 and core.connector.num_reserved_blocks == 2
        before = front.storage.clone()
        others = [b for b in range(16) if b not in blocks]
        for grant, run in (("t1", others[:1]), ("guessed", blocks), ("", blocks)):
            with pytest.raises(ValueError, match="not reserved for its transfer"):
                writer.write_rows(msgspec.structs.replace(target, grant=grant), run, torch.ones(BLOCK, width))
        assert torch.equal(front.storage, before)
        rows = torch.randn(2 * BLOCK, width)
        writer.write_rows(msgspec.structs.replace(target, grant="t1"), blocks, rows)
        assert torch.equal(front.read_rows(blocks, 0, 2 * BLOCK), rows.to(front.planes.dtype))
        core.connector.release(ReleaseKV("t1"))  # copied in (or never taken): the blocks go, and take no write
        assert core.connector.num_reserved_blocks == 0
        with pytest.raises(ValueError, match="not reserved for its transfer"):
            writer.write_rows(msgspec.structs.replace(target, grant="t1"), blocks, rows)
        too_many = core.connector.reserve(ReserveKV("t2", 1, 17 * BLOCK))
        assert too_many.block_ids is None and "--kv-buffer-blocks" in too_many.error

        # A request arriving with its run: its transfer is over, so the run takes no more writes from here (before,
        # until the front end released it once the engine had copied it in at admission, later).
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        processed, handoff, rows = prefilled(Prefill(tiny_ckpt("qwen2_vl")), PROMPTS[0], params, "r")
        run = core.connector.reserve(ReserveKV("t3", 2, rows.shape[0])).block_ids
        granted = msgspec.structs.replace(target, grant="t3")
        writer.write_rows(granted, run, rows)
        core.add_request("r", ProcessedPrompt(processed.prompt_token_ids, [], processed.positions,
                                              processed.position_delta, block_rows=run, kv_in_blocks=True),
                         params, kv_transfer=handoff)
        with pytest.raises(ValueError, match="not reserved for its transfer"):
            writer.write_rows(granted, run[:1], torch.full((BLOCK, width), float("nan")))
        assert torch.equal(front.read_rows(run, 0, rows.shape[0]), rows.to(front.planes.dtype))
    finally:
        writer.close()
        receiver.close()
        core.shutdown()
        front.unlink()
