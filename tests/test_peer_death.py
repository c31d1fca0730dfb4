"""A prefill instance that dies under a decode instance's transfers (issue #78): every request it held fails over
at once (retried on another instance, or a 503), within the heartbeat window, never a 500 and never after the
transfer timeout: a death while the request waits for receive blocks, a death before the first message, after
asking for more blocks, and a restart at the same address (a new process answers the pings, knowing nothing of the
transfers). The peers here are real ZeroMQ sockets that write their rows through the receiver's row socket."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from vlserve.core.config import DisaggArgs
from vlserve.core.wire import Framer
from vlserve.disagg.messages import (
    PROTOCOL,
    Ping,
    Pong,
    ReceiverToSender,
    RowSegment,
    RowsGiven,
    RowsWanted,
    TransferChunk,
    TransferFailed,
    TransferRequest,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_client import PeerClient, PeerConn
from vlserve.disagg.peer_kinds import PREFILL_PEERS
from vlserve.disagg.registry import InstanceInfo
from vlserve.disagg.transports.base import ChunkData
from vlserve.disagg.transports.zmq import ZmqTransport
from vlserve.engine.transfer_buffers import TransferBuffers

BLOCK, WIDTH, TOKENS = 16, 24, 40  # a first run of 32 rows: the prefill asks for more blocks, then one chunk
MODEL = SimpleNamespace(max_model_len=1024, model=SimpleNamespace(modalities=("image",), is_hybrid=False))
GUARD_S = 60.0  # far below the transfer timeout (an hour): a request waiting for it fails the test
HEARTBEAT_S = 0.05
# "Within seconds" of the heartbeat window: a generous bound on a shared machine, not a performance check.
WITHIN_S = 10.0


class FakePrefill:
    """A prefill instance's data socket on loopback: answers pings (with its boot id) and each request by asking
    for the blocks its prompt's KV needs beyond the first run, then with the rows in one chunk written through the
    receiver's row socket. `messages`: how many it sends before it dies (its socket closed, nothing more
    answered); `silent`: it takes requests and never answers them (alive: its pings are answered); `gives_up`:
    it fails each request right after asking for more blocks (as its timeout waiting for them would)."""

    def __init__(self, port: int | None = None, boot: str = "b1", messages: int | None = None,
                 silent: bool = False, gives_up: bool = False):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        if port is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            _bind_again(self.sock, port)
        self.port, self.boot, self.messages, self.silent, self.gives_up = port, boot, messages, silent, gives_up
        self.given: list[RowsGiven] = []
        self.transport = ZmqTransport("127.0.0.1")
        self.requests: dict[tuple[str, int], TransferRequest] = {}
        self.sent = 0
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        framer = Framer(ReceiverToSender)
        try:
            while True:
                peer, *frames = await self.sock.recv_multipart()
                msg = framer.decode(frames)
                if isinstance(msg, Ping):
                    await self.sock.send_multipart([peer, *Framer(Pong).encode(
                        Pong(msg.nonce, 0, "arch", 8, 0, kv_width=WIDTH, boot=self.boot, protocol=PROTOCOL))])
                elif isinstance(msg, TransferRequest):
                    self.requests[(msg.request_id, msg.transfer_id)] = msg
                    if self.silent:
                        continue
                    more = TOKENS - len(msg.block_ids) * BLOCK
                    sent = (await self._send(peer, RowsWanted(msg.request_id, msg.transfer_id, more)) if more > 0
                            else await self._chunk(peer, msg, msg.block_ids))
                    if not sent:
                        return
                    if self.gives_up:  # a moment later: the receiver waits for those blocks by then
                        await asyncio.sleep(0.3)
                        await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, "gave up", 503))
                elif isinstance(msg, RowsGiven):
                    self.given.append(msg)
                    if self.gives_up:
                        continue
                    req = self.requests[(msg.request_id, msg.transfer_id)]
                    if not await self._chunk(peer, req, req.block_ids + msg.block_ids):
                        return
        finally:
            self.die()

    def _dies_now(self) -> bool:
        return self.messages is not None and self.sent >= self.messages

    async def _send(self, peer: bytes, msg) -> bool:
        """False once it is meant to die instead."""
        if self._dies_now():
            return False
        await self.sock.send_multipart([peer, *Framer(RowsWanted | TransferFailed).encode(msg)])
        self.sent += 1
        return True

    async def _chunk(self, peer: bytes, req: TransferRequest, blocks: list[int]) -> bool:
        """The prompt's rows into `blocks` (its first run and what it asked for); False once it dies instead."""
        if self._dies_now():
            return False
        header = TransferChunk(req.request_id, req.transfer_id, 0, TOKENS, TOKENS, 0, [], blocks,
                               [RowSegment(0, TOKENS)], False)
        data = ChunkData(torch.arange(TOKENS) + 1000 * len(self.boot), torch.zeros(TOKENS, 3, dtype=torch.int64),
                         torch.randn(TOKENS, WIDTH))
        await self.transport.send(self.sock, peer, header, data, req.target)
        self.sent += 1
        return True

    def die(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
            self.transport.close()
        if self.task is not asyncio.current_task():
            self.task.cancel()


def _bind_again(sock, port: int) -> None:
    """The port a socket closed a moment ago held (libzmq lets go of it on its I/O thread, soon after)."""
    for _ in range(100):
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.05)
    sock.bind(f"tcp://127.0.0.1:{port}")


def _client(threshold: int = 2, blocks: int = 8, transfer_timeout: float = 3600.0) -> PeerClient:
    """A decode instance's peer client, its receive blocks (`blocks` of 16 rows) served by a zmq row socket."""
    buffers = TransferBuffers.create(blocks, BLOCK, WIDTH, torch.float32, shared=False)
    opts = DisaggArgs(bootstrap="127.0.0.1:9", kv_allocate_tokens=32, transfer_backend="zmq",
                      transfer_timeout=transfer_timeout, heartbeat_interval=HEARTBEAT_S,
                      heartbeat_failure_threshold=threshold)
    client = PeerClient(MODEL, buffers, TransferMetrics(CollectorRegistry(), buffers, "decode", "kv"), opts,
                        InstanceInfo("me", "decode", "127.0.0.1:2", "127.0.0.1:3"), PREFILL_PEERS)
    client._assemble = lambda processed: processed  # what the engine would check
    return client


def _connect(client: PeerClient, fake, name: str, **options) -> PeerConn:
    """Paired, as after its first Pong; `options`: socket options of the connection (small queues)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    for option, value in options.items():
        setattr(sock, option, value)
    sock.connect(f"tcp://127.0.0.1:{fake.port}")
    peer = PeerConn(InstanceInfo(name, "prefill", f"127.0.0.1:{fake.port}"), sock, paired=True, boot=fake.boot)
    client.conns[name] = peer
    peer.reader = asyncio.create_task(client._read(peer))
    return peer


async def _until(condition, what: str) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


class StalledPrefill:
    """A prefill instance that stopped reading its socket (hung, or swamped): what is sent to it fills the queues
    (its own and the connection's, kept small here) until sending blocks."""

    def __init__(self, boot: str = "st"):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.linger, self.sock.rcvhwm, self.sock.rcvbuf = 0, 1, 1 << 16
        self.port, self.boot = self.sock.bind_to_random_port("tcp://127.0.0.1"), boot

    def die(self) -> None:
        self.sock.close(0)


def _run(scenario, **client_args) -> None:
    """`scenario(client)`, then: every block back (once the failed try's quarantine ends), no grant left open."""
    client = _client(scenario.threshold, **client_args)

    async def go():
        pings = asyncio.create_task(client._ping_loop())
        try:
            await scenario(client)
        finally:
            pings.cancel()
            for peer in list(client.conns.values()):
                client._drop(peer, "test over", quiet=True)

    try:
        asyncio.run(go())
        for holder, blocks, _ in client.quarantined.values():  # (what its deadline does)
            client._free(holder, blocks)
        assert client.buffers.num_free == client.buffers.num_blocks
        assert len(client.buffers.grants) == 0, "a block stayed open to a peer's writes"
    finally:
        client.transport.close()


async def _answered_by(client: PeerClient, ask: asyncio.Task, fake: FakePrefill, since: float | None = None) -> None:
    """`ask` answered by `fake`; with `since`, within the heartbeat window (and a few seconds) of that time."""
    processed, _ = await asyncio.wait_for(ask, GUARD_S)
    assert processed.prompt_token_ids == [t + 1000 * len(fake.boot) for t in range(TOKENS)]
    client.take_release(processed)()
    if since is not None:
        window = client.opts.heartbeat_interval * client.opts.heartbeat_failure_threshold
        took = time.monotonic() - since
        assert took < window + WITHIN_S, f"failed over {took:.1f}s later, not within the heartbeat window"


def _scenario(threshold: int):
    def mark(fn):
        fn.threshold = threshold
        return fn
    return mark


def test_a_prefill_dropped_while_its_request_waits_for_blocks_fails_over_at_once():
    """Before, the request went on waiting for receive blocks (up to the transfer timeout) for a peer that was
    gone, then sent its request on the dropped peer's closed socket: ZMQError, a 500."""
    @_scenario(threshold=1000)  # dropped by the test, not by missed pings
    async def scenario(client):
        a = FakePrefill()
        peer_a = _connect(client, a, "A")
        held = client.buffers.allocate(8 * BLOCK)  # the pool is full: the request waits for blocks
        ask = asyncio.create_task(client.send_prompt("r1", "p", {}, {}, {}))
        await asyncio.sleep(0.3)
        assert not ask.done() and not a.requests
        b = FakePrefill(boot="bb")
        _connect(client, b, "B")
        since = time.monotonic()
        client._drop(peer_a, "missed 3 heartbeats")
        await asyncio.sleep(0.1)
        client.pool.free("", held)
        await _answered_by(client, ask, b, since)
        assert not a.requests and len(b.requests) == 1
        a.die()
        b.die()

    _run(scenario)


def test_a_prefill_restarted_at_its_address_fails_its_transfers_over():
    """A new process at the dead one's address answers the pings, so it was never dropped: its transfers waited
    for the transfer timeout. Now its Pong's boot id tells it apart."""
    @_scenario(threshold=1000)  # pings keep being answered: only the boot id can tell
    async def scenario(client):
        a = FakePrefill(silent=True)
        peer_a = _connect(client, a, "A")
        ask = asyncio.create_task(client.send_prompt("r1", "p", {}, {}, {}))
        await _until(lambda: a.requests, "the request reached A")
        b = FakePrefill(boot="bb")
        _connect(client, b, "B")
        a.die()
        since = time.monotonic()
        restarted = FakePrefill(port=a.port, boot="b2", silent=True)
        await _answered_by(client, ask, b, since)
        assert not peer_a.alive and "restarted" in peer_a.gone
        assert not restarted.requests
        restarted.die()
        b.die()

    _run(scenario)


@pytest.mark.parametrize("messages", [0, 1], ids=["before its first message", "after asking for more blocks"])
def test_a_prefill_that_dies_mid_transfer_fails_over_within_the_heartbeat_window(messages):
    @_scenario(threshold=2)
    async def scenario(client):
        a = FakePrefill(messages=messages)
        _connect(client, a, "A")
        ask = asyncio.create_task(client.send_prompt("r1", "p", {}, {}, {}))
        await _until(lambda: a.requests, "the request reached A")
        since = time.monotonic()  # A dies now (before its first message) or once it has asked for more blocks
        b = FakePrefill(boot="bb")
        _connect(client, b, "B")
        await _answered_by(client, ask, b, since)
        assert a.sent == messages and "A" not in client.conns
        b.die()

    _run(scenario)


def test_a_stalled_prefill_is_dropped_and_requests_waiting_on_its_socket_fail_over():
    """A prefill that stops reading, with large prompts queued for it (its queue full): before, the ping loop's
    heartbeat waited in that queue too, so no peer was ever dropped again; and once it was dropped (its socket
    closed) every request whose send or abort waited there got CancelledError (an ASGI error, not a 503)
    instead of its retry elsewhere. The blocks of a request that never went out wait out no quarantine."""
    @_scenario(threshold=1000)  # lowered once its queue is full
    async def scenario(client):
        stalled = StalledPrefill()
        peer = _connect(client, stalled, "S", sndhwm=1, sndbuf=1 << 16)
        asks = [asyncio.create_task(client.send_prompt(f"r{i}", f"{i}" + "x" * 2**20, {}, {}, {})) for i in range(6)]
        # Those sent time out (1 s) and send their abort into the full queue; the others still wait to be sent.
        await asyncio.sleep(2.0)
        assert peer.alive and not any(ask.done() for ask in asks)
        b = FakePrefill(boot="bb")
        _connect(client, b, "B")
        since = time.monotonic()
        client.opts.heartbeat_failure_threshold = 2
        for ask in asks:
            await _answered_by(client, ask, b, since)
        assert not peer.alive and "missed" in peer.gone
        assert len(client.quarantined) < len(asks), "a request that never went out kept its blocks"
        assert len(b.requests) == len(asks)
        stalled.die()
        b.die()

    _run(scenario, blocks=32, transfer_timeout=1.0)


def test_blocks_of_a_request_that_never_went_out_are_freed_at_once():
    """The blocks came just as the peer was dropped: its request was never sent, so no write can come into
    them. Before, they waited out the whole quarantine (15 s) like those of a request the peer had."""
    @_scenario(threshold=1000)
    async def scenario(client):
        a, b = FakePrefill(), FakePrefill(boot="bb")
        peer_a = _connect(client, a, "A")
        allocate = client._allocate

        async def allocated_as_it_drops(holder, rows, peer, queue=None):
            run = await allocate(holder, rows, peer, queue)
            if peer is peer_a:
                _connect(client, b, "B")
                client._drop(peer_a, "missed 3 heartbeats")
            return run

        client._allocate = allocated_as_it_drops
        await _answered_by(client, asyncio.create_task(client.send_prompt("r1", "p", {}, {}, {})), b)
        assert not a.requests and not client.quarantined
        a.die()
        b.die()

    _run(scenario)


def test_a_peer_writes_nothing_into_a_run_once_its_chunk_header_came():
    """Before, a run took its peer's writes until the transfer succeeded: between the receiver's check that the
    rows are finite and the engine reading them, the peer could overwrite them (with NaN). Now a run's grant
    closes as its chunk's header arrives, before the check."""
    @_scenario(threshold=1000)
    async def scenario(client):
        a = FakePrefill()
        _connect(client, a, "A")
        check, refused = client._rows_finite, []

        async def checked_then_overwritten(header, run):
            finite = await check(header, run)
            (request,) = a.requests.values()
            try:
                a.transport.write_rows(request.target, run, torch.full((BLOCK, WIDTH), float("nan")))
            except ValueError as e:
                refused.append(str(e))
            return finite

        client._rows_finite = checked_then_overwritten
        processed, _ = await asyncio.wait_for(client.send_prompt("r1", "p", {}, {}, {}), GUARD_S)
        assert len(refused) == 1 and all("not reserved for its transfer" in e for e in refused), refused
        assert client.buffers.rows_finite(processed.block_rows, torch.arange(TOKENS))
        client.take_release(processed)()
        a.die()

    _run(scenario)


def test_a_peer_of_another_transfer_protocol_is_not_paired():
    """A deployment in the middle of an upgrade: a prefill instance that speaks the older protocol (it would
    send its KV in parts, which this receiver refuses; or never answer `RowsWanted`) is not paired, with why."""
    client = _client()
    client.cfg = SimpleNamespace(max_model_len=1024, model=SimpleNamespace(
        modalities=("image",), is_hybrid=False, architecture="arch", text=SimpleNamespace(hidden_size=8), side_rows=0,
        kv_row_width=WIDTH))  # what the fake's Pong says it serves

    async def go():
        sockets = []
        for name, protocol in (("O", None), ("N", PROTOCOL)):
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sockets.append(sock)
            peer = client.conns[name] = PeerConn(InstanceInfo(name, "prefill", "127.0.0.1:2"), sock)
            extra = {} if protocol is None else {"protocol": protocol}  # (none sent: an older one)
            client._pair(peer, Pong(1, 0, "arch", 8, 0, kv_width=WIDTH, boot=name, **extra))
            assert peer.paired is (protocol is not None) and (name in client.conns) is peer.paired
        for sock in sockets:
            sock.close(0)

    try:
        asyncio.run(go())
    finally:
        client.transport.close()


def test_a_prefill_that_fails_while_its_blocks_are_awaited_gets_none_of_them():
    """It asked for more blocks, then gave up (its own wait timed out, or its engine died) while this server's
    pool was full: the wait for them ends at its failure, and the blocks freed later go to the retry, not to the
    transfer that is over (before, they were reserved for it and sent to a peer that no longer wanted them)."""
    @_scenario(threshold=1000)
    async def scenario(client):
        a = FakePrefill(gives_up=True)
        peer_a = _connect(client, a, "A")
        held = client.buffers.allocate(6 * BLOCK)  # room for the first run (2 blocks) and no more
        ask = asyncio.create_task(client.send_prompt("r1", "p", {}, {}, {}))
        await _until(lambda: a.requests, "the request reached A")
        b = FakePrefill(boot="bb")
        _connect(client, b, "B")
        # A's failure (0.3 s after its ask) ends its transfer while its blocks are awaited; then blocks come free
        await _until(lambda: not peer_a.transfers, "A's transfer ended at its failure")
        client.pool.free("", held)
        await _answered_by(client, ask, b)
        assert a.given == [], "blocks freed later went to the transfer that had failed"
        a.die()
        b.die()

    _run(scenario)
