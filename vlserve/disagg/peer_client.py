"""The receiving side of disaggregation: find peers, send them prompts, receive their output into this server's
receive blocks (a run of blocks per round; a resumed transfer adds a run), and check everything a peer sends
before the engine may read it. The peers are encoders (embedding rows of media tokens, for a language server or
a prefill instance) or prefill instances (every prompt token's KV row and the first token, for a decode
instance): one protocol, told apart by `PeerKind` (disagg.peer_kinds), which also says what a request is keyed
by when picking its peer.

A transfer goes Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed | Rejected (the request's
own fault). Every block it holds is freed on every path but success, which hands them to the caller. A peer
that fails, dies, times out or answers nonsense gets the request retried once elsewhere; then a clear 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ServiceUnavailableError
from vlserve.core.messages import Handoff
from vlserve.core.prompt import ProcessedPrompt, media_kinds_needed
from vlserve.core.lora import AdapterRef
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import Framer
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.registries import open_registry
from vlserve.disagg.registry import InstanceInfo, reachable_host, registry_target
from vlserve.disagg.messages import (
    AbortTransfer,
    TransferRequest,
    SenderToReceiver,
    ReceiverToSender,
    Ping,
    Pong,
    ResumeRequest,
    TransferChunk,
    TransferFailed,
    TransferState,
    TransferTarget,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PeerKind, rendezvous_score
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.received import ReceivedChunks
from vlserve.disagg.receive_pool import EngineKVBlocks, LocalBlocks
from vlserve.disagg.transports.base import HeadersOnly, Transport, in_thread, quarantine_s
from vlserve.frontend.config import FrontendConfig
from vlserve.engine.prompt_check import check_prompt
from vlserve.engine.transfer_buffers import TransferBuffers

logger = logging.getLogger("vlserve.disagg")
INLINE_CHECK_VALUES = 1 << 16  # a finiteness check of more values than this runs off the event loop


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
    transfers: dict[tuple[str, int], asyncio.Queue] = field(default_factory=dict)
    reader: asyncio.Task | None = None


class PeerClient:
    def __init__(self, cfg: FrontendConfig, buffers: TransferBuffers, metrics: TransferMetrics, opts: DisaggArgs,
                 self_info: InstanceInfo, kind: PeerKind = ENCODER_PEERS, model: str = "",
                 pool: LocalBlocks | EngineKVBlocks | None = None, target: TransferTarget | None = None):
        """`buffers`: where peers write (receive buffers, or a decode engine's KV cache); `pool`: who gives out
        their blocks (default: this process, from `buffers`); `target`: how peers write into them when another
        process registered them (a decode engine its KV cache): this one then only checks headers. `self_info`:
        how this server registers, its addresses already the ones peers reach it by; `model`: the model as the
        roles name it (the registry's default namespace)."""
        self.cfg, self.buffers, self.metrics, self.opts, self.kind = cfg, buffers, metrics, opts, kind
        self.pool = pool or LocalBlocks(buffers)
        self._releases: dict[int, Callable[[], None]] = {}  # id of a handed-over prompt -> what frees its blocks
        host = reachable_host(self_info.http_address.rsplit(":", 1)[0], toward=registry_target(opts).host)
        if target is not None:
            self.transport: Transport = HeadersOnly(opts.transfer_backend, host)
            self.target = target
        else:
            self.transport = TRANSPORTS[opts.transfer_backend](host, opts.disagg_secret)
            self.target = self.transport.target(buffers)  # how peers reach our buffers, sent with each request
        self.requests, self.replies = Framer(ReceiverToSender), Framer(SenderToReceiver)
        self.ctx = zmq.asyncio.Context.instance()
        self.conns: dict[str, PeerConn] = {}
        self.dropped: dict[str, float] = {}  # peer id -> until when it stays dropped
        self.auth = PeerAuth(opts.disagg_secret)
        require_secret_off_loopback(self.auth, registry_target(opts).host, "this server's registry")
        self.registry = open_registry(opts, self_info, model,
                                      load_fn=lambda: sum(e.in_flight for e in self.conns.values()), auth=self.auth)
        self._ids = itertools.count()
        # blocks a peer may still write: (holder, blocks, until when)
        self.quarantined: dict[tuple[str, int], tuple[str, list[int], float]] = {}
        # After a failed transfer over a transport that writes in place, its blocks wait this long at most for the
        # sender's word that nothing more is written (its writes time out sooner: transports.base).
        self.quarantine_s = quarantine_s()
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
        self.transport.close()

    @property
    def num_available(self) -> int:
        return sum(e.alive and e.paired for e in self.conns.values())

    # ---- membership and heartbeats ----------------------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        listing_failed = False
        while True:
            # A registry with a watch (etcd) wakes this at once on a join; the bootstrap one after the interval.
            await self.registry.wait_for_change(self.opts.heartbeat_interval)
            now = time.monotonic()
            for key in [k for k, (_, _, until) in self.quarantined.items() if until < now]:
                self._free(*self.quarantined.pop(key)[:2])  # no word from the peer: gone, or its writes timed out
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
        """Must not die: without it no dead peer is ever dropped. So it cannot raise: a peer its ping cannot
        reach is dropped (its transfers fail and retry elsewhere), anything else is logged and tried next round."""
        nonce = itertools.count()
        while True:
            try:
                self.buffers.restore_file()  # a buffer file resized behind our back: put back before anyone reads it
            except Exception:  # noqa: BLE001 - tried again next round; a transfer finding it resized fails alone
                logger.exception("could not restore the receive buffer file")
            for peer in list(self.conns.values()):
                if not peer.alive:
                    continue  # dropped meanwhile (its socket is closed)
                peer.missed += 1
                if peer.missed > self.opts.heartbeat_failure_threshold:
                    self._drop(peer, f"missed {peer.missed - 1} heartbeats")
                    continue
                try:
                    await peer.sock.send_multipart(self.requests.encode(Ping(next(nonce))))
                except Exception as e:  # noqa: BLE001 - this peer only
                    self._drop(peer, f"its heartbeat could not be sent: {e}")
            await asyncio.sleep(self.opts.heartbeat_interval)

    def _drop(self, peer: PeerConn, why: str, quiet: bool = False, for_s: float | None = None) -> None:
        if self.conns.pop(peer.info.instance_id, None) is None:
            return
        peer.alive = False
        quarantine = 2 * self.opts.heartbeat_failure_threshold * self.opts.heartbeat_interval
        self.dropped[peer.info.instance_id] = time.monotonic() + (for_s if for_s is not None else quarantine)
        if not quiet:
            logger.warning("%s %s (%s) dropped: %s", self.kind.name, peer.info.instance_id[:8], peer.info.address,
                           why)
        for q in peer.transfers.values():
            q.put_nowait(PeerFailure(f"{self.kind.name} {peer.info.address} {why}"))
        if peer.reader is not None:
            peer.reader.cancel()
        peer.sock.close(linger=0)

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
        peer.missed = 0  # any message proves it is alive
        if isinstance(msg, Pong):
            self._pair(peer, msg)
            return
        key = (msg.request_id, msg.transfer_id)
        if isinstance(msg, TransferFailed) and key in self.quarantined:
            self._free(*self.quarantined.pop(key)[:2])  # the peer will not write into them any more
            return
        q = peer.transfers.get(key)
        if q is not None:
            q.put_nowait((msg, frames))

    def _pair(self, peer: PeerConn, pong: Pong) -> None:
        if peer.paired:
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
        peer.paired = True
        peer.modalities = frozenset(pong.modalities)
        self._peer_paired.set()
        logger.info("%s %s paired (%s)", self.kind.name, peer.info.instance_id[:8], peer.info.address)

    # ---- transfers ---------------------------------------------------------------------------------------------
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

    async def send_prompt(self, request_id: str, prompt: str, media: dict, uuids: dict, mm_kwargs: dict,
                          params: SamplingParams | None = None, lora: AdapterRef | None = None
                          ) -> tuple[ProcessedPrompt, Handoff | None]:
        """The processed prompt, its rows in receive blocks (`block_rows`) the caller must free; from a prefill
        instance (`params` given) also its first token and random state. `lora`: to an encoder, a tower adapter it
        runs the media with; to a prefill instance, the adapter it computes the prompt with."""
        if self.kind.key_is_costly(media):
            key = await in_thread(self.kind.affinity_key, prompt, media, uuids)
        else:
            key = self.kind.affinity_key(prompt, media, uuids)
        needs = (frozenset() if self.kind.rows_for_every_token
                 else media_kinds_needed(media, mm_kwargs, self.cfg.model.modalities))
        tried: set[str] = set()
        last: Exception | None = None
        for _ in range(2):  # the first try and one retry on another peer
            peer = self._pick(key, tried, needs) if tried else await self._first_peer(key, needs)
            if peer is None:
                break
            tried.add(peer.info.instance_id)
            try:
                return await self._transfer(peer, request_id, prompt, media, uuids, mm_kwargs, params, lora)
            except PeerFailure as e:
                retry = len(tried) < 2 and self._pick(key, tried, needs) is not None
                logger.warning("request %s: %s %s failed (%s)%s", request_id, self.kind.name, peer.info.address, e,
                               f"; retrying on another {self.kind.name}" if retry else "")
                last = e
        if last is None:
            what = f"{self.kind.name} that encodes {' and '.join(sorted(needs))}" if needs else self.kind.name
            raise ServiceUnavailableError(f"no {what} is available (none paired within "
                                          f"--peer-wait-timeout {self.opts.peer_wait_timeout:g}s); retry later")
        raise ServiceUnavailableError(f"the {self.kind.name} failed after {len(tried)} attempt(s): {last}")

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

    async def _allocate(self, holder: str, rows: int) -> list[int]:
        return await self.pool.allocate(holder, rows, self.opts.transfer_timeout)

    def _free(self, holder: str, blocks: list[int]) -> None:
        self.pool.free(holder, blocks)

    def free(self, blocks: list[int]) -> None:
        """Receive blocks of this process's own pool (see `take_release` for a handed-over prompt's)."""
        self.pool.free("", blocks)

    def take_release(self, processed: ProcessedPrompt) -> Callable[[], None]:
        """What gives back the blocks of a prompt `send_prompt` returned, once the engine is done with its rows (or
        never got them); called once."""
        return self._releases.pop(id(processed))

    async def _transfer(self, peer: PeerConn, request_id: str, prompt: str, media: dict, uuids: dict,
                        mm_kwargs: dict, params: SamplingParams | None, lora: AdapterRef | None = None
                        ) -> tuple[ProcessedPrompt, Handoff | None]:
        self.buffers.restore_file()
        restored = self.buffers.restored  # a restore later on means this transfer's rows were lost
        tid = next(self._ids)
        holder = f"{tid}:{request_id}"  # what this transfer's blocks are held under
        queue: asyncio.Queue = asyncio.Queue()
        peer.transfers[(request_id, tid)] = queue
        peer.in_flight += 1
        enter = self._state_logger(request_id, tid, peer)
        enter(TransferState.BOOTSTRAPPING)
        t0 = time.perf_counter()
        blocks: list[int] = []  # every block this transfer holds, in row order
        succeeded = False
        try:
            pool_rows = self.pool.capacity_rows  # a smaller pool: all of it at most
            tail = self.kind.tail_rows(self.cfg)
            run = await self._allocate(holder, min(self.kind.allocate_rows(self.opts) + tail, pool_rows))
            blocks += run
            await peer.sock.send_multipart(self.requests.encode(TransferRequest(
                request_id, tid, prompt, media, uuids, mm_kwargs or {}, run, self.buffers.block_tokens, self.target,
                params, lora)))
            enter(TransferState.WAITING_FOR_INPUT)
            received = ReceivedChunks(self.kind.rows_for_every_token, self.buffers.block_tokens,
                                      self.cfg.max_model_len, tail)
            while True:
                header, frames = await self._next_chunk(queue, enter)
                enter(TransferState.TRANSFERRING)
                if problems := received.problems(header, run):
                    raise PeerFailure(f"the {self.kind.name} sent " + "; ".join(problems))
                try:
                    tokens = await self.transport.receive(header, frames, self.buffers)
                except ValueError as e:
                    raise PeerFailure(f"malformed chunk: {e}") from None
                self.metrics.bytes(tokens.nbytes)
                if self.buffers.restore_file() or self.buffers.restored != restored:
                    raise PeerFailure("this server's receive buffer file was resized by someone else during the "
                                      "transfer: what arrived is lost")
                if not await self._rows_finite(header, run):
                    raise PeerFailure(f"the {self.kind.name} sent rows holding NaN or infinite values")
                received.add(header, tokens)
                if not header.partial:
                    break
                self.metrics.resume()
                run = await self._allocate(holder, received.rows_left)
                blocks += run
                await peer.sock.send_multipart(self.requests.encode(ResumeRequest(request_id, tid, received.tokens,
                                                                                 run)))
            keep = self.buffers.blocks_for(received.rows)  # the rest of the run was never written
            self._free(holder, blocks[keep:])
            blocks = blocks[:keep]
            processed = self._assemble(received.prompt(prompt, blocks))
            if (header.handoff is not None) != (params is not None):
                raise PeerFailure("a prefill's first token is missing" if params is not None else
                                  "an encoder sent a first token")
            enter(TransferState.SUCCESS)
            self.metrics.transfer_latency.observe(time.perf_counter() - t0)
            succeeded = True
            self._releases[id(processed)] = self.pool.handed(holder, blocks)
            return processed, header.handoff
        except InvalidInputError:
            enter(TransferState.REJECTED)
            raise
        except BaseException:
            enter(TransferState.FAILED)
            if blocks:
                # It may be writing into them right now: they wait for its word (or the deadline, longer than its
                # writes may take). Also when it was dropped (missed heartbeats): a write it started may still
                # land. Quarantined before the abort is sent, so a send that fails cannot free them.
                self.quarantined[(request_id, tid)] = (holder, blocks, time.monotonic() + self.quarantine_s)
                blocks = []
            if peer.alive:  # let the peer drop what it holds for us
                try:
                    await peer.sock.send_multipart(self.requests.encode(AbortTransfer(request_id, tid)))
                except Exception as e:  # noqa: BLE001 - the transfer's own failure is what its caller must see
                    logger.warning("request %s: could not send the abort to %s %s: %s", request_id, self.kind.name,
                                   peer.info.address, e)
            raise
        finally:
            if not succeeded:
                self._free(holder, blocks)
            peer.in_flight -= 1
            peer.transfers.pop((request_id, tid), None)

    async def _rows_finite(self, header: TransferChunk, run: list[int]) -> bool:
        """The chunk's rows, as they landed in our blocks, hold only finite values (a peer's NaN would otherwise
        become a 200 of garbage). One pass over the rows: off the event loop once it is more than a few."""
        # The chunk's rows fill its run from the first slot. A hybrid model's state rows (the tail, after the last
        # token's) hold float32 bytes, not values of the rows' dtype: the engine checks the unpacked state.
        rows = torch.arange(sum(s.num_rows for s in header.segments if s.token < header.total_tokens))
        if rows.numel() * self.buffers.layout.width <= INLINE_CHECK_VALUES:
            return self.buffers.rows_finite(run, rows)
        return await in_thread(self.buffers.rows_finite, run, rows)

    async def _next_chunk(self, queue: asyncio.Queue, enter) -> tuple[TransferChunk, list]:
        try:
            got = await asyncio.wait_for(queue.get(), self.opts.transfer_timeout)
        except asyncio.TimeoutError:
            raise PeerFailure(f"no answer within {self.opts.transfer_timeout:.0f}s") from None
        if isinstance(got, Exception):
            raise got
        msg, frames = got
        if isinstance(msg, TransferFailed):
            if 400 <= msg.status < 500:  # the request's own fault, with the aggregated server's status
                err = MediaTooLargeError(msg.message) if msg.status == 413 else InvalidInputError(msg.message)
                raise err
            raise PeerFailure(msg.message)
        return msg, frames

    def _assemble(self, processed: ProcessedPrompt) -> ProcessedPrompt:
        """The prompt as the engine will see it, checked like anything else the engine admits."""
        try:
            check_prompt(processed, self.cfg, (self.buffers.num_blocks, self.buffers.block_tokens))
        except InvalidInputError as e:
            raise PeerFailure(f"the {self.kind.name}'s output does not check out: {e}") from None
        return processed

    def _state_logger(self, request_id: str, tid: int, peer: PeerConn):
        """Counts each state in the metrics and shows the transitions in debug logs."""
        def enter(state: TransferState) -> None:
            self.metrics.state(state)
            logger.debug("transfer %s/%d via %s: %s", request_id, tid, peer.info.address, state.value)
        return enter
