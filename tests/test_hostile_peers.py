"""Hostile peers (issue #25): the registry judges a call by its headers before reading its body, bounds the body
and refuses a replayed signature; a truncated shared-memory buffer file is a clean error, not a SIGBUS, and is
put back by the language server; rows that are not finite (NaN, inf) never reach the engine's requests: a
language server's front end refuses those in its receive buffers, a decode engine those in its KV cache, which
its front end never maps."""

from __future__ import annotations

import asyncio
import glob
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from tests.server_utils import free_port, wait_healthy
from tests.test_disagg import (
    Cluster,
    ask,
    expected_text,
    offline,  # noqa: F401 - a fixture
    picture_chat,
    wait_language_blocks_free,
)
from vlserve.core.config import DisaggArgs
from vlserve.core.errors import ServiceUnavailableError
from vlserve.core.wire import Framer
from vlserve.disagg.auth import HEADER, NonceMemory, PeerAuth, ReplayMemoryFull
from vlserve.disagg.bootstrap import MAX_BODY_BYTES, InstanceInfo, build_bootstrap_app
from vlserve.disagg.messages import (
    AbortTransfer,
    ItemMeta,
    Ping,
    Pong,
    ReceiverToSender,
    RowSegment,
    SenderToReceiver,
    TransferChunk,
    TransferFailed,
    TransferRequest,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_client import PeerClient, PeerConn, PeerFailure
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PREFILL_PEERS
from vlserve.disagg.receive_pool import EngineKVBlocks
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.transports.base import ChunkData
from vlserve.disagg.transports.row_writer import TransportKVReceiver, decode_target
from vlserve.engine.transfer_buffers import TransferBuffers

SECRET = "correct horse battery staple"
REG = b'{"instance_id": "i1", "role": "encode", "address": "127.0.0.1:5"}'

PICTURE_MODEL = SimpleNamespace(max_model_len=1024, model=SimpleNamespace(modalities=("image", "video"),
                                                                           is_hybrid=False))


# ---- registry ------------------------------------------------------------------------------------------------
class _CountedBody:
    """A request body streamed in 1 MiB pieces, counting how many the server pulled."""

    def __init__(self, pieces: int, piece: bytes = b"x" * (1 << 20)):
        self.pieces, self.piece, self.pulled = pieces, piece, 0

    async def __aiter__(self):
        for _ in range(self.pieces):
            self.pulled += 1
            yield self.piece


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://registry")


def test_an_unsigned_or_stale_call_is_refused_before_its_body_is_read():
    app = build_bootstrap_app(auth=PeerAuth(SECRET))
    stale = PeerAuth(SECRET).sign("POST", "/register", REG, now=time.time() - 3600)

    async def go():
        async with _client(app) as c:
            for headers in ({}, {HEADER: "1:2"}, stale):
                body = _CountedBody(32)
                r = await c.post("/register", content=body, headers=headers)
                assert r.status_code == 401, r.text
                assert body.pulled <= 1, f"the registry read {body.pulled} MiB of an unauthenticated body"

    asyncio.run(go())


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_body_over_the_limit_is_refused_with_413(secret):
    app = build_bootstrap_app(auth=PeerAuth(secret))
    big = b" " * (MAX_BODY_BYTES + 1) + REG

    async def go():
        async with _client(app) as c:
            # Announced by Content-Length: refused unread.
            r = await c.post("/register", content=big, headers=PeerAuth(secret).sign("POST", "/register", big))
            assert r.status_code == 413 and "bytes" in r.json()["error"]["message"], r.text
            # Streamed without a length (chunked): refused once the limit is passed, the rest unread.
            body = _CountedBody(32, b" " * (1 << 20))
            whole = b" " * (32 << 20)
            r = await c.post("/register", content=body, headers=PeerAuth(secret).sign("POST", "/register", whole))
            assert r.status_code == 413, r.text
            assert body.pulled <= 2
            # A registration of ordinary size still goes through.
            r = await c.post("/register", content=REG, headers=PeerAuth(secret).sign("POST", "/register", REG))
            assert r.status_code == 200, r.text

    asyncio.run(go())


def test_a_replayed_signed_call_is_refused():
    app = build_bootstrap_app(auth=PeerAuth(SECRET))

    async def go():
        async with _client(app) as c:
            signed = PeerAuth(SECRET).sign("POST", "/register", REG)
            assert (await c.post("/register", content=REG, headers=signed)).status_code == 200
            replay = await c.post("/register", content=REG, headers=signed)
            assert replay.status_code == 401 and "replayed" in replay.json()["error"]["message"]
            # The same call signed anew (a fresh nonce) is fine: the client's retries are not replays.
            fresh = PeerAuth(SECRET).sign("POST", "/register", REG)
            assert (await c.post("/register", content=REG, headers=fresh)).status_code == 200

    asyncio.run(go())


def test_the_nonce_is_signed_and_the_memory_is_bounded_and_forgets_by_time():
    auth = PeerAuth(SECRET)
    header = auth.sign("POST", "/heartbeat", b"{}", now=1000.0)[HEADER]
    ts, nonce, mac = header.split(":")
    other = f"{ts}:{'0' * 32}:{mac}"  # a nonce swapped under the same MAC
    assert auth.verify("POST", "/heartbeat", b"{}", header, now=1001.0)
    assert not auth.verify("POST", "/heartbeat", b"{}", other, now=1001.0)

    memory = NonceMemory(max_entries=2)
    assert auth.verify("POST", "/heartbeat", b"{}", header, now=1001.0, nonces=memory)
    assert not auth.verify("POST", "/heartbeat", b"{}", header, now=1002.0, nonces=memory)  # replayed
    assert not auth.verify("POST", "/heartbeat", b"{}", other, now=1002.0, nonces=memory)  # forged: not remembered
    assert len(memory) == 1
    memory.admit("b" * 32, 1000.0, 1002.0)
    with pytest.raises(ReplayMemoryFull):  # full of fresh nonces: refuse rather than forget one early
        memory.admit("c" * 32, 1000.0, 1002.0)
    assert memory.admit("c" * 32, 1000.0, 1061.0) and len(memory) == 1  # the stale ones went


def _raw_post(port: int, headers: dict[str, str], body: bytes = b"") -> bytes:
    """Sends the head of a POST /register (and `body`, however short of its Content-Length); the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /register HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        return s.recv(4096)


def test_a_real_registry_answers_a_huge_announced_body_without_waiting_for_it():
    """400 MB announced, a few bytes sent: the answer comes at once (before, the registry read it all first)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vlserve", "bootstrap", "--port", str(port)],
                            env={**os.environ, "VLSERVE_DISAGG_SECRET": SECRET},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", 20, "registry", lambda: proc.stdout.read().decode())
        huge = {"Content-Length": str(400 << 20), "Content-Type": "application/json"}
        assert _raw_post(port, huge, b"{").startswith(b"HTTP/1.1 401")
        signed = {**huge, **PeerAuth(SECRET).sign("POST", "/register", b"{")}
        assert _raw_post(port, signed, b"{").startswith(b"HTTP/1.1 413")
        ok = {"Content-Length": str(len(REG)), **PeerAuth(SECRET).sign("POST", "/register", REG)}
        assert _raw_post(port, ok, REG).startswith(b"HTTP/1.1 200")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---- shared memory: a truncated buffer file --------------------------------------------------------------------
_TRUNCATE_THEN_WRITE = """
import asyncio, os, torch
from vlserve.disagg.transports.loopback import Loopback, media_chunk
from vlserve.engine.transfer_buffers import TransferBuffers

buffers = TransferBuffers.create(64, 16, 48, torch.float32)
link = Loopback("shm", buffers)
header, data = media_chunk([3, 4], 16, 20, (2, 18), 48)

async def go():
    await link.connect()
    await link.transfer(header, data)  # the encoder maps the file
    os.truncate(buffers.layout.path, 4096)  # something truncates it behind everyone's back
    try:
        await link.transfer(header, data)
    except ValueError as e:
        print("REFUSED:", e, flush=True)
    assert buffers.restore_file() and buffers.restored == 1  # the language server notices and puts it back
    await link.transfer(header, data)
    assert torch.equal(buffers.read_rows([3, 4], 0, 16), data.rows)
    print("SERVING", flush=True)

asyncio.run(go())
link.close()
print(buffers.layout.path, flush=True)  # exits without unlink(): the file must go anyway
"""


def test_a_truncated_shm_file_is_a_clean_error_then_restored_and_gone_at_exit():
    """Run apart: before the fix, writing the mapped memory past the new end of the file was a SIGBUS."""
    child = subprocess.run([sys.executable, "-c", _TRUNCATE_THEN_WRITE], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-3000:])
    lines = child.stdout.splitlines()
    assert lines[0].startswith("REFUSED:") and "has 4096 bytes" in lines[0] and "nothing written" in lines[0]
    assert lines[1] == "SERVING"
    assert not os.path.exists(lines[2]), "the buffer file outlived its process"


@pytest.mark.parametrize("ending", ["return", "raise SystemExit(3)", "raise RuntimeError('boom')"])
def test_the_buffer_file_goes_when_its_process_exits_without_unlink(ending):
    code = ("import torch\nfrom vlserve.engine.transfer_buffers import TransferBuffers\n"
            "buffers = TransferBuffers.create(4, 4, 8, torch.float32)\nprint(buffers.layout.path, flush=True)\n"
            f"def end():\n    {ending}\nend()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    path = child.stdout.splitlines()[0]
    assert path and not os.path.exists(path), f"{path} outlived its process ({child.returncode})"


# ---- rows that are not finite ----------------------------------------------------------------------------------
class _Peer:
    """An encoder (or prefill instance) behind a PeerClient, through the real transport: answers each request
    with one chunk of 20 tokens, poisoning a row of its first try when the request id says so ("nan", "inf"):
    `poisoned`, shared by the peers of one client, holds the ids poisoned already."""

    def __init__(self, client, backend: str, name: str = "fake", poisoned: set | None = None):
        self.client, self.transport = client, TRANSPORTS[backend]("127.0.0.1")
        self.poisoned = set() if poisoned is None else poisoned
        self.conn = PeerConn(InstanceInfo(name, client.kind.role, "127.0.0.1:1"), self, paired=True,
                             modalities=frozenset({"image", "video"}))
        client.conns[name] = self.conn

    async def send_multipart(self, frames, copy: bool = True) -> None:  # what the client sends its peer
        msg = Framer(ReceiverToSender).decode(frames)
        if not isinstance(msg, TransferRequest):
            return  # an abort: nothing of ours is in flight
        n, width = 20, self.client.buffers.layout.width
        if self.client.kind.rows_for_every_token:  # KV: a row for every token
            items, segments = [], [RowSegment(0, n)]
        else:  # embeddings: rows for the picture's tokens 2..17
            items, segments = [ItemMeta(2, 16, (1, 8, 8), "h")], [RowSegment(2, 16)]
        rows = torch.randn(segments[0].num_rows, width)
        for bad, value in (("nan", float("nan")), ("inf", float("inf"))):
            if bad in msg.request_id and msg.request_id not in self.poisoned:
                rows[7, width // 2] = value
                self.poisoned.add(msg.request_id)
        header = TransferChunk(msg.request_id, msg.transfer_id, 0, n, n, 0, items, msg.block_ids, segments, False)
        data = ChunkData(torch.arange(n), torch.zeros(n, 3, dtype=torch.int64), rows)
        try:
            await self.transport.send(_Back(self.conn), b"peer", header, data, msg.target)
        except ValueError as e:  # the receiver refused the write: the transfer fails (as a sender says it)
            failed = TransferFailed(msg.request_id, msg.transfer_id, f"the rows could not be written: {e}")
            self.conn.transfers[(msg.request_id, msg.transfer_id)].put_nowait((failed, []))
            return
        if "truncate" in msg.request_id:  # the file shrinks after the write, before the receiver looks
            os.truncate(self.client.buffers.layout.path, 0)


class _Back:
    """The peer's socket toward the client: hands each message over as the client's reader would."""

    def __init__(self, enc):
        self.conn = enc

    async def send_multipart(self, frames, copy: bool = True) -> None:
        frames = [bytes(memoryview(f)) for f in frames[1:]]  # [0] is the peer's id on a ROUTER
        msg = Framer(SenderToReceiver).decode(frames)
        self.conn.transfers[(msg.request_id, msg.transfer_id)].put_nowait((msg, frames))


def _receiver(kind: str, backend: str = "zmq"):
    buffers = TransferBuffers.create(16, 16, 96, torch.bfloat16, shared=backend == "shm")
    opts = DisaggArgs(bootstrap="127.0.0.1:9", media_allocate_rows=32, kv_allocate_tokens=32,
                      transfer_backend=backend, peer_wait_timeout=1.0, transfer_timeout=10.0)
    peers = PREFILL_PEERS if kind == "kv" else ENCODER_PEERS
    client = PeerClient(PICTURE_MODEL, buffers,
                        TransferMetrics(CollectorRegistry(), buffers, "language", kind), opts,
                        InstanceInfo("me", "language", "127.0.0.1:2", "127.0.0.1:3"), peers)
    # What the engine would be handed: the blocks, which the caller frees once done.
    client._assemble = lambda processed: processed
    return client, _Peer(client, backend)


def test_rows_with_nan_or_inf_fail_their_request_and_others_keep_going():
    """Receive buffers of the front end's own (media rows from an encoder): it checks their rows itself."""
    client, _ = _receiver("embedding")

    async def go():
        media = {"image": ["http://x/1.png"]}
        asks = [client.send_prompt(rid, "p", media, {}, {}) for rid in ("ok-1", "nan-1", "ok-2", "inf-1", "ok-3")]
        return await asyncio.gather(*asks, return_exceptions=True)

    try:
        results = asyncio.run(go())
        for rid, got in zip(("ok-1", "nan-1", "ok-2", "inf-1", "ok-3"), results):
            if rid.startswith("ok"):
                assert not isinstance(got, BaseException), (rid, got)
                client.take_release(got[0])()
            else:
                assert isinstance(got, ServiceUnavailableError), (rid, got)
                assert "NaN or infinite values" in str(got), got
        assert len(client.quarantined) == 2  # the failed ones wait for the peer's word (written in place)
        for holder, blocks, _ in client.quarantined.values():  # (the peer would confirm its abort)
            client._free(holder, blocks)
        assert client.buffers.num_free == client.buffers.num_blocks  # every block came back
    finally:
        client.transport.close()


class _Reservations:
    """What a decode engine does with the KV blocks its front end reserves for transfers (frontend.kv_reservations
    and the DecodeConnector), straight on its KV cache: each holder's blocks open to its writes until released."""

    def __init__(self, kv: TransferBuffers):
        self.kv, self.held = kv, {}

    async def reserve(self, holder: str, rows: int) -> list[int]:
        blocks = self.kv.allocate(rows)
        assert blocks is not None, "the test's KV cache is too small"
        self.kv.grants.open(holder, blocks)
        self.held.setdefault(holder, []).extend(blocks)
        return blocks

    def release(self, holder: str, block_ids: list[int] | None = None) -> None:
        held = self.held.pop(holder, [])
        gone = [b for b in held if block_ids is None or b in block_ids]
        if len(gone) < len(held):
            self.held[holder] = [b for b in held if b not in gone]
        self.kv.grants.close(gone)
        self.kv.free(gone)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_a_decode_front_end_reads_no_kv_row_and_nan_rows_are_refused_where_they_land(backend):
    """#67: before, a decode instance's front end mapped its engine's whole KV cache only to scan what prefill
    instances wrote there for NaN. Now it knows the cache by its layout only, and the rows are checked where they
    land: over zmq the engine's row socket refuses the write, so that transfer fails and the request is retried
    on another prefill instance; over shm (written one-sided, nothing can refuse it) the rows reach the engine,
    whose admission check fails that request alone (test_kv_row_writes). Others keep going, every block is back."""
    kv = TransferBuffers.create(32, 16, 96, torch.float32)  # the decode engine's KV cache, in its process
    receiver = TransportKVReceiver(backend, "127.0.0.1", None, kv, check_finite=True)
    opts = DisaggArgs(bootstrap="127.0.0.1:9", kv_allocate_tokens=32, transfer_backend=backend,
                      peer_wait_timeout=1.0, transfer_timeout=10.0)
    client = PeerClient(PICTURE_MODEL, kv.layout, TransferMetrics(CollectorRegistry(), None, "decode", "kv"), opts,
                        InstanceInfo("me", "decode", "127.0.0.1:2", "127.0.0.1:3"), PREFILL_PEERS,
                        pool=EngineKVBlocks(_Reservations(kv), 32 * 16), target=decode_target(receiver.target))
    client._assemble = lambda processed: processed
    assert receiver.rows_checked == (backend == "zmq")
    assert not hasattr(client.buffers, "planes"), "the front end maps the engine's KV cache"
    poisoned: set[str] = set()
    peers = [_Peer(client, backend, name, poisoned) for name in ("A", "B")]
    ids = ("ok-1", "nan-1", "ok-2", "inf-1", "ok-3")

    async def go():
        return await asyncio.gather(*[client.send_prompt(rid, "p", {}, {}, {}) for rid in ids],
                                    return_exceptions=True)

    try:
        results = asyncio.run(go())
        assert poisoned == {"nan-1", "inf-1"}
        for rid, got in zip(ids, results):
            assert not isinstance(got, BaseException), (rid, got)
            processed = got[0]
            # What the engine reads as it admits the request (DecodeConnector, for one-sided writes)
            landed = kv.rows_finite(processed.block_rows, torch.arange(20))
            assert landed == (rid.startswith("ok") or backend == "zmq"), rid
            client.take_release(processed)()
        # Over zmq the refused transfers' blocks wait for their peer's word (it would confirm the abort)
        assert len(client.quarantined) == (2 if backend == "zmq" else 0)
        for holder, blocks, _ in client.quarantined.values():
            client._free(holder, blocks)
        assert kv.num_free == kv.num_blocks  # every block came back
    finally:
        for peer in peers:
            peer.transport.close()
        client.transport.close()
        receiver.close()
        kv.unlink()


def test_the_receiver_restores_a_truncated_shm_file_and_fails_only_what_it_lost():
    client, _ = _receiver("embedding", "shm")
    buffers, media = client.buffers, {"image": ["http://x/1.png"]}

    async def go():
        got, _ = await client.send_prompt("ok-1", "p", media, {}, {})  # the encoder has the file mapped now
        client.take_release(got)()
        os.truncate(buffers.layout.path, 0)  # between transfers: put back before the next one is sent
        got, _ = await client.send_prompt("ok-2", "p", media, {}, {})
        client.take_release(got)()
        assert buffers.restored == 1 and os.path.getsize(buffers.layout.path) == buffers.layout.nbytes
        with pytest.raises(ServiceUnavailableError, match="resized by someone else"):  # during one: it is lost
            await client.send_prompt("truncate-1", "p", media, {}, {})
        assert buffers.restored == 2
        for holder, blocks, _ in client.quarantined.values():  # (the encoder would confirm its abort)
            client._free(holder, blocks)
        got, _ = await client.send_prompt("ok-3", "p", media, {}, {})  # and the next one is fine
        client.take_release(got)()

    try:
        asyncio.run(go())
        assert buffers.num_free == buffers.num_blocks
    finally:
        client.transport.close()
        buffers.unlink()


def test_a_deployment_over_shm_survives_its_buffer_file_being_truncated(tiny_ckpt, offline):
    """The issue as reported: the encoder died of SIGBUS, every picture request after was a 503 and the file
    outlived the shutdown. Now the language server puts the file's size back before the encoder writes again."""
    cluster, path = Cluster(tiny_ckpt("qwen2_vl"), {"main": []}, backend="shm"), None
    try:
        cluster.wait_encoders("main", 1)
        client, language, encoder = cluster.client("main"), cluster.languages["main"], cluster.encoders["A"]
        assert ask(client, picture_chat(1)) == expected_text(offline, picture_chat(1))  # the encoder maps the file
        [path] = glob.glob(f"/dev/shm/vlserve-transfer-{language.proc.pid}-*") or \
            glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vlserve-transfer-{language.proc.pid}-*"))
        os.truncate(path, 0)
        for seed in (2, 3):
            assert ask(client, picture_chat(seed)) == expected_text(offline, picture_chat(seed))
        assert encoder.proc.poll() is None, encoder.read_log()[-3000:]
        assert "restoring its size" in language.read_log()
        wait_language_blocks_free(lambda: cluster.metrics("main"))
    finally:
        cluster.close()
    assert path and not os.path.exists(path), "the buffer file outlived the language server"


# ---- a failed transfer's blocks, and loops that must not die (issue #43) --------------------------------------
class _SilentPeer:
    """A peer that takes a request and never answers (its write may still be on its way); `abort_fails`: sending
    it the abort fails (its socket is gone)."""

    def __init__(self, client, name: str = "silent", abort_fails: bool = False):
        self.client, self.abort_fails = client, abort_fails
        self.conn = PeerConn(InstanceInfo(name, client.kind.role, "127.0.0.1:1"), self, paired=True,
                             modalities=frozenset({"image", "video"}))
        client.conns[name] = self.conn
        self.requests: list = []
        self.pings = 0

    async def send_multipart(self, frames, copy: bool = True) -> None:
        msg = Framer(ReceiverToSender).decode(frames)
        if isinstance(msg, Ping):
            self.pings += 1
        elif isinstance(msg, AbortTransfer):
            if self.abort_fails:
                raise zmq.ZMQError(zmq.ENOTSOCK, "the peer's socket is gone")
        else:
            self.requests.append(msg)

    def close(self, linger: int = 0) -> None:
        pass


async def _until(condition, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _blocks_in_use(client) -> int:
    return client.buffers.num_blocks - client.buffers.num_free


@pytest.mark.parametrize("how", ["dropped after missed heartbeats", "the abort cannot be sent"])
def test_a_failed_transfers_blocks_wait_in_quarantine_whatever_becomes_of_the_peer(how):
    """Over a transport that writes in place, the peer may still be writing into the blocks of a transfer that
    failed: a peer dropped for missed heartbeats too (its write times out only later), and also when the abort
    cannot be sent. Before, those blocks were freed at once, for another request to be written over."""
    client, _ = _receiver("embedding", "shm")
    client.conns.clear()
    peer = _SilentPeer(client, abort_fails=how == "the abort cannot be sent")

    async def go():
        ask = asyncio.create_task(client.send_prompt("r1", "p", {"image": ["http://x/1.png"]}, {}, {}))
        await _until(lambda: peer.requests, "the request reached the peer")
        held = _blocks_in_use(client)
        if how == "dropped after missed heartbeats":
            client._drop(peer.conn, "missed 3 heartbeats")
        else:
            (queue,) = peer.conn.transfers.values()
            queue.put_nowait(PeerFailure("it broke"))
        with pytest.raises(ServiceUnavailableError):
            await ask
        return held

    try:
        held = asyncio.run(go())
        assert held > 0
        [(key, (_, blocks, _))] = client.quarantined.items()
        assert key[0] == "r1" and len(blocks) == held and _blocks_in_use(client) == held, \
            "a failed transfer's blocks were freed while its peer may still write into them"
        client._free(*client.quarantined.pop(key)[:2])  # what its deadline (or the peer's word) does
        assert client.buffers.num_free == client.buffers.num_blocks
    finally:
        client.transport.close()
        client.buffers.unlink()


def test_the_heartbeat_loop_survives_a_peer_whose_socket_fails():
    """Before, a ping that could not be sent ended the heartbeat loop for good: no peer was ever dropped again.
    Now that peer is dropped (its transfers retry elsewhere) and the others keep being pinged."""
    client, _ = _receiver("embedding")
    client.conns.clear()
    client.opts.heartbeat_interval = 0.01
    good, bad = _SilentPeer(client, "good"), _SilentPeer(client, "bad")

    async def broken(frames, copy: bool = True):
        raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")

    bad.send_multipart = broken

    async def go():
        loop = asyncio.create_task(client._ping_loop())
        try:
            await _until(lambda: good.pings >= 2 or loop.done(), "two pings to the good peer")
            assert not loop.done(), loop.exception()
        finally:
            loop.cancel()
        assert "bad" not in client.conns and "good" in client.conns

    try:
        asyncio.run(go())
    finally:
        client.transport.close()


class _Inbox:
    """A peer's socket as the reader sees it: hands out what is queued; an exception is raised instead."""

    def __init__(self, *items):
        self.items = asyncio.Queue()
        for item in items:
            self.items.put_nowait(item)

    async def recv_multipart(self):
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, linger: int = 0) -> None:
        pass


def test_the_reader_survives_a_message_it_fails_on_and_a_failed_socket_drops_the_peer():
    """Before, one exception while handling a peer's message ended its reader: nothing from that peer was read
    again (its transfers waited for their timeout) while it stayed listed. Now that message is logged and the
    next one is read; a socket that fails drops the peer, whose transfers fail (and retry elsewhere) at once."""
    client, _ = _receiver("embedding")
    client.conns.clear()
    replies = Framer(SenderToReceiver)
    pong = replies.encode(Pong(1, 0, "arch", 8, 0))
    chunk = replies.encode(TransferChunk("r", 7, 0, 1, 1, 0, [], [0], [], False))
    sock = _Inbox(pong, chunk, zmq.ZMQError(zmq.ENOTSOCK, "socket closed"))
    peer = PeerConn(InstanceInfo("flaky", "encode", "127.0.0.1:1"), sock)
    client.conns["flaky"] = peer
    inbox: asyncio.Queue = asyncio.Queue()
    peer.transfers[("r", 7)] = inbox

    def pair(*_):
        raise RuntimeError("a bug handling this message")

    client._pair = pair

    async def go():
        peer.reader = asyncio.create_task(client._read(peer))
        got = await asyncio.wait_for(inbox.get(), 10)  # read after the message it failed on
        assert isinstance(got[0], TransferChunk)
        failure = await asyncio.wait_for(inbox.get(), 10)  # its socket failed: the transfer hears at once
        assert isinstance(failure, PeerFailure)
        assert "flaky" not in client.conns
        await asyncio.gather(peer.reader, return_exceptions=True)

    try:
        asyncio.run(go())
    finally:
        client.transport.close()
