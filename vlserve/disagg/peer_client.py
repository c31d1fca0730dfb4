"""The receiving side of disaggregation: find peers, send them prompts, receive their output into this server's
receive blocks (a run of blocks per round; a resumed transfer adds a run), and check everything a peer sends
before the engine may read it (but the values of rows in blocks a decode engine registered: that engine checks
those, and this process maps none of them). The peers are encoders (embedding rows of media tokens, for a
language server or a prefill instance) or prefill instances (every prompt token's KV row and the first token,
for a decode instance): one protocol, told apart by `PeerKind` (disagg.peer_kinds), which also says what a
request is keyed by when picking its peer.

A transfer goes Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed | Rejected (the request's
own fault). Every block it holds is freed on every path but success, which hands them to the caller. A peer
that fails, dies, times out or answers nonsense gets the request retried once elsewhere; then a clear 503.
Finding, pairing, pinging and dropping the peers is disagg.peer_links'.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ServiceUnavailableError
from vlserve.core.messages import Handoff
from vlserve.core.prompt import ProcessedPrompt, media_kinds_needed
from vlserve.core.lora import AdapterRef
from vlserve.core.sampling_params import SamplingParams
from vlserve.disagg.registry import InstanceInfo, reachable_host, registry_target
from vlserve.disagg.messages import (
    AbortTransfer,
    TransferRequest,
    ResumeRequest,
    RowsGiven,
    RowsWanted,
    TransferChunk,
    TransferFailed,
    TransferState,
    TransferTarget,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PeerKind
from vlserve.disagg.peer_links import PeerConn, PeerFailure, PeerLinks
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.received import ReceivedChunks
from vlserve.disagg.receive_pool import EngineKVBlocks, EngineKVLayout, LocalBlocks
from vlserve.disagg.transports.base import ABORT_ACK_STATUS, HeadersOnly, Transport, in_thread, quarantine_s
from vlserve.frontend.config import FrontendConfig
from vlserve.engine.prompt_check import check_prompt
from vlserve.engine.transfer_buffers import BufferLayout, TransferBuffers

logger = logging.getLogger("vlserve.disagg")
INLINE_CHECK_VALUES = 1 << 16  # a finiteness check of more values than this runs off the event loop


class NotSent(PeerFailure):
    """A message to the peer did not go out (it was dropped, or its socket failed): it cannot act on it."""


class PeerClient(PeerLinks):
    def __init__(self, cfg: FrontendConfig, buffers: TransferBuffers | BufferLayout, metrics: TransferMetrics,
                 opts: DisaggArgs, self_info: InstanceInfo, kind: PeerKind = ENCODER_PEERS, model: str = "",
                 pool: LocalBlocks | EngineKVBlocks | None = None, target: TransferTarget | None = None):
        """`buffers`: where peers write (receive buffers, or the layout of a decode engine's KV cache, which this
        process does not map); `pool`: who gives out their blocks (default: this process, from `buffers`);
        `target`: how peers write into them when another process registered them (a decode engine its KV cache,
        or its receive blocks): this one then only checks headers, and that process the rows' values.
        `self_info`: how this server registers, its addresses already the ones peers reach it by; `model`: the
        model as the roles name it (the registry's default namespace)."""
        super().__init__(cfg, opts, kind, self_info, model)
        if isinstance(buffers, BufferLayout):
            if target is None or pool is None:
                raise ValueError("buffers known by their layout only are another process's: give their pool and "
                                 "target")
            buffers = EngineKVLayout(buffers)
        self.buffers, self.metrics = buffers, metrics
        self.pool = pool or LocalBlocks(buffers)
        self._releases: dict[int, Callable[[], None]] = {}  # id of a handed-over prompt -> what frees its blocks
        host = reachable_host(self_info.http_address.rsplit(":", 1)[0], toward=registry_target(opts).host)
        # Rows in buffers this process registered are checked for NaN and inf here; those of blocks another process
        # registered are its to check (a decode engine: its row socket refuses such a write, or it fails the
        # request at admission), so no KV byte is read in a front end.
        self.checks_rows = target is None
        if target is not None:
            self.transport: Transport = HeadersOnly(opts.transfer_backend, host)
            self.target = target
        else:
            self.transport = TRANSPORTS[opts.transfer_backend](host, opts.disagg_secret)
            self.target = self.transport.target(buffers)  # how peers reach our buffers, sent with each request
        self._ids = itertools.count()
        # blocks a peer may still write: (holder, blocks, until when)
        self.quarantined: dict[tuple[str, int], tuple[str, list[int], float]] = {}
        # After a failed transfer over a transport that writes in place, its blocks wait this long at most for the
        # sender's word that nothing more is written (its writes time out sooner: transports.base).
        self.quarantine_s = quarantine_s()

    async def stop(self) -> None:
        await super().stop()
        self.transport.close()

    def _every_round(self) -> None:
        try:
            self.buffers.restore_file()  # a buffer file resized behind our back: put back before anyone reads it
        except Exception:  # noqa: BLE001 - tried again next round; a transfer finding it resized fails alone
            logger.exception("could not restore the receive buffer file")
        # A failed transfer's blocks with no word from its peer (gone, or its writes timed out) go back.
        now = time.monotonic()
        for key in [k for k, (_, _, until) in self.quarantined.items() if until < now]:
            self._free(*self.quarantined.pop(key)[:2])

    def _on_transfer_reply(self, peer: PeerConn, msg, frames: list) -> None:
        key = (msg.request_id, msg.transfer_id)
        if isinstance(msg, TransferFailed) and key in self.quarantined:
            # Only the answer to our abort says no write of the peer's runs any more (a failure it reports
            # meanwhile may come while its engine still writes): the blocks go back then, or at the deadline.
            if msg.status == ABORT_ACK_STATUS:
                self._free(*self.quarantined.pop(key)[:2])
            return
        q = peer.transfers.get(key)
        if q is not None:
            q.put_nowait((msg, frames))

    # ---- transfers ---------------------------------------------------------------------------------------------
    async def send_prompt(self, request_id: str, prompt: str, media: dict, uuids: dict, mm_kwargs: dict,
                          params: SamplingParams | None = None, lora: AdapterRef | None = None,
                          prefer: str | None = None) -> tuple[ProcessedPrompt, Handoff | None]:
        """The processed prompt, its rows in receive blocks (`block_rows`) the caller must free; from a prefill
        instance (`params` given) also its first token and random state. `lora`: to an encoder, a tower adapter it
        runs the media with; to a prefill instance, the adapter it computes the prompt with. `prefer`: the
        instance id of a peer to try first if it is paired (one that holds the work already), else the usual."""
        if self.kind.key_is_costly(media):
            key = await in_thread(self.kind.affinity_key, prompt, media, uuids)
        else:
            key = self.kind.affinity_key(prompt, media, uuids)
        needs = (frozenset() if self.kind.rows_for_every_token
                 else media_kinds_needed(media, mm_kwargs, self.cfg.model.modalities))
        tried: set[str] = set()
        last: Exception | None = None
        for _ in range(2):  # the first try and one retry on another peer
            peer = (self._pick(key, tried, needs) if tried else
                    self._paired(prefer, needs) or await self._first_peer(key, needs))
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

    async def _allocate(self, holder: str, rows: int, peer: PeerConn, queue: asyncio.Queue | None = None
                        ) -> list[int]:
        """Blocks for `rows` more rows of the transfer to `peer`. A wait for them (a full pool) ends when the peer
        is dropped: its transfer fails over now, not at the end of the wait (--transfer-timeout); and, given the
        transfer's `queue`, when the peer says something meanwhile (its failure: the blocks are not wanted)."""
        allocating = asyncio.ensure_future(self.pool.allocate(holder, rows, self.opts.transfer_timeout))
        gone = asyncio.ensure_future(peer.dropped.wait())
        said = asyncio.ensure_future(queue.get()) if queue is not None else None
        waits = (allocating, gone) if said is None else (allocating, gone, said)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._drop_allocation(holder, allocating)
            raise
        finally:
            gone.cancel()
            if said is not None and not said.done():
                said.cancel()  # (an item is taken off the queue only when the get completes)
        if said is not None and said.done() and not said.cancelled():
            self._drop_allocation(holder, allocating)
            msg, _ = self._as_chunk(said.result())  # its failure raises here
            raise PeerFailure(f"the {self.kind.name} sent {type(msg).__name__} while waiting for its blocks")
        if not allocating.done():
            allocating.cancel()
            await asyncio.gather(allocating, return_exceptions=True)
            self._drop_allocation(holder, allocating)
            raise PeerFailure(f"{self.kind.name} {peer.info.address} {peer.gone}")
        return allocating.result()  # (a peer dropped just now: the send that follows fails over)

    def _drop_allocation(self, holder: str, allocating: asyncio.Future) -> None:
        """An allocation nobody waits for any more: cancelled, or what it got given back."""
        if not allocating.done():
            allocating.cancel()  # (a reservation cancelled gives back what its answer brings)
        elif not allocating.cancelled() and allocating.exception() is None:
            self._free(holder, allocating.result())

    def _free(self, holder: str, blocks: list[int]) -> None:
        self.pool.free(holder, blocks)

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
        # What this transfer's blocks are held under, and its grant: only the peer it is sent to can name it, and
        # a zmq row socket takes writes only into blocks held under it.
        holder = f"{tid}:{secrets.token_hex(16)}:{request_id[:64]}"
        queue: asyncio.Queue = asyncio.Queue()
        peer.transfers[(request_id, tid)] = queue
        peer.in_flight += 1
        enter = self._state_logger(request_id, tid, peer)
        enter(TransferState.BOOTSTRAPPING)
        t0 = time.perf_counter()
        blocks: list[int] = []  # every block this transfer holds, in row order
        named = 0  # blocks[:named] were named to the peer (it may write them); the rest it never heard of
        succeeded = False
        asked_at = time.monotonic()
        try:
            pool_rows = self.pool.capacity_rows  # a smaller pool: all of it at most
            tail = self.kind.tail_rows(self.cfg)
            run = await self._allocate(holder, min(self.kind.allocate_rows(self.opts) + tail, pool_rows), peer)
            blocks += run
            target = None if self.target is None else msgspec.structs.replace(self.target, grant=holder)
            asked_at = time.monotonic()
            await self._send(peer, TransferRequest(request_id, tid, prompt, media, uuids, mm_kwargs or {}, run,
                                                   self.buffers.block_tokens, target, params,
                                                   None if lora is None else lora.for_peer(),
                                                   write_within_s=self.opts.transfer_timeout))
            named = len(blocks)
            enter(TransferState.WAITING_FOR_INPUT)
            received = ReceivedChunks(self.kind.rows_for_every_token, self.buffers.block_tokens,
                                      self.cfg.max_model_len, tail)
            extended = False  # the first run grew by what the peer asked for (once, before any chunk)
            while True:
                header, frames = await self._next_chunk(queue, enter)
                if isinstance(header, RowsWanted):  # a prefill instance that knows its prompt's length
                    if received.tokens or extended:
                        raise PeerFailure(f"the {self.kind.name} asked for more blocks twice, or after its rows")
                    extended = True
                    more = await self._more_rows(holder, header, peer, tail, queue)
                    self.metrics.resume()
                    blocks += more
                    run = run + more  # its one chunk fills the first run and these, in order
                    # Its engine writes every block from when this reaches it, for the time it was given: they are
                    # kept that long after now if the transfer fails (`_quarantine_until`).
                    asked_at = time.monotonic()
                    await self._send(peer, RowsGiven(request_id, tid, more))
                    named = len(blocks)
                    continue
                # Its rows are in (the peer says): the run takes no more writes before they are checked and read.
                self.pool.seal(run)
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
                if self.checks_rows and not await self._rows_finite(header, run):
                    raise PeerFailure(f"the {self.kind.name} sent rows holding NaN or infinite values")
                received.add(header, tokens)
                if not header.partial:
                    break
                if self.kind.rows_for_every_token:
                    raise PeerFailure("the prefill instance sent its KV in parts without asking for the blocks first")
                self.metrics.resume()
                run = await self._allocate(holder, received.rows_left, peer)
                blocks += run
                await self._send(peer, ResumeRequest(request_id, tid, received.tokens, run))
                named = len(blocks)
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
        except BaseException as e:
            enter(TransferState.FAILED)
            if not isinstance(e, NotSent):
                named = len(blocks)  # (a send cancelled with this task may have gone out)
            self._free(holder, blocks[named:])  # never named to the peer: no write of its can come
            blocks = blocks[:named]
            if blocks:
                # It may be writing into them right now: they wait for its word (or the deadline, longer than its
                # writes may take). Also when it was dropped (missed heartbeats): a write it started may still
                # land. Quarantined before the abort is sent, so a send that fails cannot free them.
                self.quarantined[(request_id, tid)] = (holder, blocks, self._quarantine_until(asked_at))
                blocks = []
            if peer.alive and named:  # let the peer drop what it holds for us
                await self._send_abort(peer, AbortTransfer(request_id, tid))
            raise
        finally:
            if not succeeded:
                self._free(holder, blocks)
            peer.in_flight -= 1
            peer.transfers.pop((request_id, tid), None)

    async def _more_rows(self, holder: str, msg: RowsWanted, peer: PeerConn, tail: int,
                         queue: asyncio.Queue) -> list[int]:
        """Blocks for the `num_rows` more rows a prefill instance asks for, once it knows its prompt's length (a
        failure it reports meanwhile ends the wait: `_allocate`)."""
        if not self.kind.rows_for_every_token:
            raise PeerFailure(f"the {self.kind.name} asked for more blocks")
        if not 0 < msg.num_rows <= self.cfg.max_model_len + tail:
            raise PeerFailure(f"the {self.kind.name} asked for {msg.num_rows} more rows (a prompt holds "
                              f"{self.cfg.max_model_len} tokens at most)")
        return await self._allocate(holder, msg.num_rows, peer, queue)

    def _quarantine_until(self, asked_at: float) -> float:
        """When a failed transfer's blocks go back without the peer's word. A prefill engine writes them while it
        computes the prompt, starting writes until `TransferRequest.write_within_s` (the transfer's timeout) after
        the request, or the `RowsGiven` that completed its blocks, reached it (transports.row_writer.send_deadline):
        its blocks wait that long after that message was sent (`asked_at`), then the quarantine (longer than a
        write may take, and than the message's way)."""
        until = time.monotonic() + self.quarantine_s
        if self.kind.rows_for_every_token:
            until = max(until, asked_at + self.opts.transfer_timeout + self.quarantine_s)
        return until

    async def _send(self, peer: PeerConn, msg) -> None:
        """To a peer still paired: one dropped meanwhile fails the transfer as its own failure (NotSent), to be
        retried elsewhere, never as a socket error, nor as the CancelledError its closed socket gives a send
        still waiting in its queue (a peer that stopped reading)."""
        if not peer.alive:
            raise NotSent(f"{self.kind.name} {peer.info.address} {peer.gone or 'was dropped'}")
        try:
            await peer.sock.send_multipart(self.requests.encode(msg))
        except zmq.ZMQError as e:
            raise NotSent(f"{self.kind.name} {peer.info.address} could not be sent to: {e}") from None
        except asyncio.CancelledError:
            if peer.alive or asyncio.current_task().cancelling():
                raise  # this task itself is cancelled
            raise NotSent(f"{self.kind.name} {peer.info.address} {peer.gone}") from None

    async def _send_abort(self, peer: PeerConn, abort: AbortTransfer) -> None:
        """Best effort: the transfer's own failure is what its caller must see (re-raised after this)."""
        try:
            await self._send(peer, abort)
        except Exception as e:  # noqa: BLE001 - NotSent, or a bug encoding it
            logger.warning("request %s: could not send the abort to %s %s: %s", abort.request_id, self.kind.name,
                           peer.info.address, e)

    async def _rows_finite(self, header: TransferChunk, run: list[int]) -> bool:
        """The chunk's rows, as they landed in our blocks, hold only finite values (a peer's NaN would otherwise
        become a 200 of garbage). One pass over the rows: off the event loop once it is more than a few."""
        # The chunk's rows fill its run from the first slot. A hybrid model's state rows (the tail, after the last
        # token's) hold float32 bytes, not values of the rows' dtype: the engine checks the unpacked state.
        rows = torch.arange(sum(s.num_rows for s in header.segments if s.token < header.total_tokens))
        if rows.numel() * self.buffers.layout.width <= INLINE_CHECK_VALUES:
            return self.buffers.rows_finite(run, rows)
        return await in_thread(self.buffers.rows_finite, run, rows)

    async def _next_chunk(self, queue: asyncio.Queue, enter) -> tuple[TransferChunk | RowsWanted, list]:
        try:
            got = await asyncio.wait_for(queue.get(), self.opts.transfer_timeout)
        except asyncio.TimeoutError:
            raise PeerFailure(f"no answer within {self.opts.transfer_timeout:.0f}s") from None
        return self._as_chunk(got)

    def _as_chunk(self, got) -> tuple[TransferChunk | RowsWanted, list]:
        """What the peer sent for this transfer; its failure (or the reader's) raised as the transfer's."""
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
