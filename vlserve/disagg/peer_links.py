"""The peers of a receiving server (disagg.peer_client, which sends them work): found through the registry, paired
once they answer a ping with the model this server needs, pinged every heartbeat, dropped when they stop answering
(or another process answers at their address), and picked for a request. Dropping a peer fails its transfers at
once, so they retry elsewhere within the heartbeat window, never after the transfer timeout."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from vlserve.core.config import DisaggArgs
from vlserve.core.wire import Framer
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.messages import PROTOCOL, Ping, Pong, ReceiverToSender, SenderToReceiver
from vlserve.disagg.peer_kinds import PeerKind, rendezvous_score
from vlserve.disagg.registries import open_registry
from vlserve.disagg.registry import InstanceInfo, registry_target
from vlserve.frontend.config import FrontendConfig

logger = logging.getLogger("vlserve.disagg")


class PeerFailure(Exception):
    """This peer could not deliver (it failed, died, timed out or sent nonsense): worth one retry elsewhere."""


@dataclass
class PeerConn:
    info: InstanceInfo
    sock: zmq.asyncio.Socket
    in_flight: int = 0
    missed: int = 0
    paired: bool = False  # it answered a ping and produces what this model needs
    modalities: frozenset[str] = frozenset()  # what an encoder can encode (from its Pong)
    alive: bool = True
    gone: str = ""  # why it was dropped
    boot: str = ""  # its process's boot id (from its Pong): another one at its address is a restarted peer
    transfers: dict[tuple[str, int], asyncio.Queue] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    dropped: asyncio.Event = field(default_factory=asyncio.Event)  # set with `alive` False
    ping: asyncio.Future | None = None  # its last heartbeat, while it waits in the socket's queue


class PeerLinks:
    """`_on_transfer_reply` (a peer's message about a transfer) and `_every_round` (once per heartbeat) are the
    transfers' own (PeerClient)."""

    def __init__(self, cfg: FrontendConfig, opts: DisaggArgs, kind: PeerKind, self_info: InstanceInfo, model: str):
        self.cfg, self.opts, self.kind = cfg, opts, kind
        self.requests, self.replies = Framer(ReceiverToSender), Framer(SenderToReceiver)
        self.ctx = zmq.asyncio.Context.instance()
        self.conns: dict[str, PeerConn] = {}
        self.dropped: dict[str, float] = {}  # peer id -> until when it stays dropped
        self.auth = PeerAuth(opts.disagg_secret)
        require_secret_off_loopback(self.auth, registry_target(opts).host, "this server's registry")
        self.registry = open_registry(opts, self_info, model,
                                      load_fn=lambda: sum(e.in_flight for e in self.conns.values()), auth=self.auth)
        self._tasks: list[asyncio.Task] = []
        self._peer_paired = asyncio.Event()

    async def start(self) -> None:
        await self.registry.start()
        await self._refresh()
        self._tasks = [asyncio.create_task(self._refresh_loop()), asyncio.create_task(self._ping_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for peer in list(self.conns.values()):
            self._drop(peer, "shutting down", quiet=True)
        await self.registry.stop()

    @property
    def num_available(self) -> int:
        return sum(e.alive and e.paired for e in self.conns.values())

    def _on_transfer_reply(self, peer: PeerConn, msg, frames: list) -> None:
        """A peer's message about one of our transfers."""

    def _every_round(self) -> None:
        """Called once per heartbeat interval (by the ping loop, which no registry outage holds up)."""

    # ---- membership and heartbeats ----------------------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        listing_failed = False
        while True:
            # A registry with a watch (etcd) wakes this at once on a join; the bootstrap one after the interval.
            await self.registry.wait_for_change(self.opts.heartbeat_interval)
            try:
                await self._refresh()
            except Exception as e:  # noqa: BLE001 - the registry may be restarting; keep the peers we know
                # Said once per outage: the registry client already reports the registry's absence and return.
                (logger.debug if listing_failed else logger.warning)(
                    "could not list %s instances (keeping the %d known): %s", self.kind.role, len(self.conns), e)
                listing_failed = True
            else:
                listing_failed = False

    async def _refresh(self) -> None:
        """The registry is for discovery only: a peer is dropped when it stops answering our pings, not
        when the registry loses sight of it (a slow heartbeat or a registry restart must not cut live work).
        A dropped peer stays out for a while: a dead one is still listed until the registry times it out."""
        listed = {i.instance_id: i for i in await self.registry.list_instances(self.kind.role)}
        now = time.monotonic()
        self.dropped = {iid: until for iid, until in self.dropped.items() if now < until}
        for iid, info in listed.items():
            if iid not in self.conns and iid not in self.dropped:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                self.auth.secure_client(sock)
                sock.connect(f"tcp://{info.address}")
                peer = PeerConn(info, sock)
                peer.reader = asyncio.create_task(self._read(peer))
                self.conns[iid] = peer
                logger.info("%s %s at %s found; pairing", self.kind.name, iid[:8], info.address)

    async def _ping_loop(self) -> None:
        """Must not die: without it no dead peer is ever dropped. So it cannot raise, and never waits for one
        peer: a ping is sent without waiting (a peer that stopped reading, its queue full, must not hold up the
        others' heartbeats); a peer its ping cannot reach is dropped, anything else logged and tried next round."""
        nonce = itertools.count()
        while True:
            try:
                self._every_round()
            except Exception:  # noqa: BLE001 - tried again next round
                logger.exception("a heartbeat round's housekeeping failed")
            for peer in list(self.conns.values()):
                if not peer.alive:
                    continue  # dropped meanwhile (its socket is closed)
                peer.missed += 1
                if peer.missed > self.opts.heartbeat_failure_threshold:
                    self._drop(peer, f"missed {peer.missed - 1} heartbeats")
                    continue
                try:
                    self._ping(peer, next(nonce))
                except Exception:  # noqa: BLE001 - this peer only, this round
                    logger.exception("could not ping %s %s", self.kind.name, peer.info.address)
            await asyncio.sleep(self.opts.heartbeat_interval)

    def _ping(self, peer: PeerConn, nonce: int) -> None:
        if peer.ping is not None and not peer.ping.done():
            return  # the last one still waits in its queue: this round is missed too
        peer.ping = asyncio.ensure_future(peer.sock.send_multipart(self.requests.encode(Ping(nonce))))
        peer.ping.add_done_callback(functools.partial(self._pinged, peer))

    def _pinged(self, peer: PeerConn, sent: asyncio.Future) -> None:
        if sent.cancelled():  # its socket was closed: dropped already
            return
        if (e := sent.exception()) is not None:
            self._drop(peer, f"its heartbeat could not be sent: {e}")

    def _drop(self, peer: PeerConn, why: str, quiet: bool = False, for_s: float | None = None) -> None:
        if self.conns.pop(peer.info.instance_id, None) is None:
            return
        peer.alive, peer.gone = False, why
        peer.dropped.set()
        quarantine = 2 * self.opts.heartbeat_failure_threshold * self.opts.heartbeat_interval
        self.dropped[peer.info.instance_id] = time.monotonic() + (for_s if for_s is not None else quarantine)
        if not quiet:
            logger.warning("%s %s (%s) dropped: %s", self.kind.name, peer.info.instance_id[:8], peer.info.address,
                           why)
        for q in peer.transfers.values():
            q.put_nowait(PeerFailure(f"{self.kind.name} {peer.info.address} {why}"))
        if peer.reader is not None:
            peer.reader.cancel()
        peer.sock.close(linger=0)  # (sends waiting in its queue are cancelled: see PeerClient._send)

    async def _read(self, peer: PeerConn) -> None:
        """Must not die quietly: a peer whose reader is gone stays listed while its transfers wait for their
        timeout. A message it fails on is logged and the next one read; a socket that fails drops the peer (its
        transfers fail at once and retry elsewhere)."""
        while True:
            try:
                frames = await peer.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self._drop(peer, f"its socket failed: {e}")
                return
            try:
                self._on_reply(peer, frames)
            except Exception:  # noqa: BLE001 - that message only
                logger.exception("failed on a message from %s %s", self.kind.name, peer.info.address)

    def _on_reply(self, peer: PeerConn, frames: list) -> None:
        try:
            msg = self.replies.decode(frames)
        except Exception as e:  # noqa: BLE001
            logger.warning("undecodable message from %s %s: %s", self.kind.name, peer.info.address, e)
            return
        if isinstance(msg, Pong) and peer.paired and msg.boot != peer.boot:
            # Another process answers at its address (restarted there): what the one we paired with held is lost.
            self._drop(peer, "restarted (its transfers are lost)")
            return
        peer.missed = 0  # any message proves it is alive
        if isinstance(msg, Pong):
            self._pair(peer, msg)
        else:
            self._on_transfer_reply(peer, msg, frames)

    def _pair(self, peer: PeerConn, pong: Pong) -> None:
        if peer.paired:
            return
        if pong.protocol != PROTOCOL:
            logger.error("%s %s speaks transfer protocol %d; this server speaks %d (a deployment mid-upgrade: run "
                         "the same vlserve version on every role): not paired", self.kind.name, peer.info.address,
                         pong.protocol, PROTOCOL)
            self._drop(peer, "it speaks another transfer protocol", quiet=True, for_s=300.0)
            return
        ours = self.kind.expects(self.cfg)
        theirs = (pong.architecture, pong.hidden_size, pong.side_rows, pong.kv_width, pong.state_rows)
        if theirs != ours:
            logger.error("%s %s serves %s (hidden size %d, %d side rows per media token, KV rows of %d, %d state "
                         "rows); this server needs %s (hidden size %d, %d side rows per media token, KV rows of %d, "
                         "%d state rows): not paired", self.kind.name,
                         peer.info.address, theirs[0][:64], *theirs[1:], *ours)
            self._drop(peer, "its model does not match", quiet=True, for_s=300.0)
            return
        peer.paired, peer.boot = True, pong.boot
        peer.modalities = frozenset(pong.modalities)
        self._peer_paired.set()
        logger.info("%s %s paired (%s)", self.kind.name, peer.info.instance_id[:8], peer.info.address)

    # ---- picking one ---------------------------------------------------------------------------------------------
    def _pick(self, key: str, exclude: set[str], needs: frozenset[str] = frozenset()) -> PeerConn | None:
        """Among the peers that encode every kind in `needs` and are within one request of the least loaded of
        them, the one the key prefers (rendezvous hashing: the same key keeps its peer, different keys spread);
        a busier peer never gets it."""
        live = [p for p in self.conns.values() if p.alive and p.paired and p.info.instance_id not in exclude
                and needs <= p.modalities]
        if not live:
            return None
        least = min(p.in_flight for p in live)
        near = [p for p in live if p.in_flight <= least + 1]
        return max(near, key=lambda p: rendezvous_score(key, p.info.instance_id))

    def _paired(self, instance_id: str | None, needs: frozenset[str] = frozenset()) -> PeerConn | None:
        """Peer `instance_id` if it is live, paired and encodes every kind in `needs`."""
        if instance_id is None:
            return None
        return next((p for p in self.conns.values() if p.info.instance_id == instance_id and p.alive and p.paired
                     and needs <= p.modalities), None)

    async def _first_peer(self, key: str, needs: frozenset[str] = frozenset()) -> PeerConn | None:
        """A peer for a request's first try: when none is paired (a start-up race, a peer restarting), wait up
        to --peer-wait-timeout for one to pair rather than refuse at once."""
        deadline = time.monotonic() + self.opts.peer_wait_timeout
        while (peer := self._pick(key, set(), needs)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._peer_paired.clear()
            try:
                await asyncio.wait_for(self._peer_paired.wait(), left)
            except asyncio.TimeoutError:
                return None
        return peer
