"""The sending side of a transfer into a receiver's blocks, shared by encode services (embedding rows) and
prefill instances (KV rows): chunk by chunk into the run of blocks the receiver offered, a resume when it
offers more (an encoder's), more blocks asked for before any row is written (a prefill instance's), an abort
that waits for any write in flight, and expiry of transfers nobody resumes.

What a transfer sends is the prompt's fill ids and positions for every token, and rows for some tokens: media
tokens' embeddings (`rows_of`, written by this process's transport), or every token's KV (`write_rows`: written
by the prefill instance's engine process, into runs it asked for before computing the prompt: `ask_rows`). Each
chunk goes as far as the receiver's run holds its rows (disagg.row_map): text tokens take no room in the
receiver's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import zmq
import zmq.asyncio

from vlserve.core.errors import InvalidInputError, VlserveError
from vlserve.core.messages import Handoff
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.wire import Framer
from vlserve.disagg.auth import PeerAuth
from vlserve.disagg.messages import (
    PROTOCOL,
    AbortTransfer,
    ItemMeta,
    Ping,
    Pong,
    ReceiverToSender,
    ResumeRequest,
    RowSegment,
    RowsGiven,
    RowsWanted,
    TransferChunk,
    TransferFailed,
    TransferRequest,
    TransferState,
    TransferTarget,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.row_map import RowMap
from vlserve.disagg.transports import ChunkData, Transport
from vlserve.disagg.transports.base import ABORT_ACK_STATUS, in_thread, quarantine_s

logger = logging.getLogger("vlserve.disagg")
Key = tuple[bytes, str, int]  # (peer, request id, transfer id)
FAILURE_PROB_ENV = "VLSERVE_TRANSFER_FAILURE_PROB"


@dataclass
class OutgoingTransfer:
    key: Key
    prompt: ProcessedPrompt
    block_tokens: int  # rows per receive block
    every_token: bool = False  # a row for every token (KV), not for media tokens only
    tail_rows: int = 0  # rows after the last token's: a hybrid model's linear states (disagg.row_map)
    # (start, end) -> the row segments of tokens start..end and their rows, in segment order
    rows_of: Callable[[int, int], tuple[list[RowSegment], torch.Tensor]] | None = None  # set before sending
    # Or, for KV kept by a prefill engine that writes it itself: (start, end, block ids) -> bytes written, once
    # the rows of tokens start..end (and the tail rows with the last token's) are in the receiver's blocks.
    write_rows: Callable[[int, int, list[int]], Awaitable[int]] | None = None
    target: TransferTarget | None = None  # where the receiver's blocks are, for transports that write them
    handoff: Handoff | None = None  # a prefill's first token and random state: sent with the last chunk
    on_end: Callable[[], None] | None = None  # releases what the transfer holds (e.g. encoder-cache entries)
    touched: float = 0.0
    sending: asyncio.Future | None = None  # done when no write into the receiver's blocks is in flight


def media_rows(prompt: ProcessedPrompt, item_rows: list[torch.Tensor], width: int):
    """`rows_of` for embedding rows: each media token's row, text tokens none."""
    def rows_of(start: int, end: int) -> tuple[list[RowSegment], torch.Tensor]:
        segments, rows = [], []
        for item, rows_of_item in zip(prompt.mm_items, item_rows):
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo < hi:
                segments.append(RowSegment(lo, hi - lo))
                rows.append(rows_of_item[lo - item.offset : hi - item.offset])
        return segments, (torch.cat(rows).cpu() if rows else torch.empty(0, width))
    return rows_of


def every_token_segments(start: int, end: int, num_tokens: int, tail_rows: int) -> list[RowSegment]:
    """KV rows: one per prompt token, then any rows after them (a hybrid model's states) with the last token's."""
    if end < num_tokens or not tail_rows:
        return [RowSegment(start, end - start)]
    return [RowSegment(start, end - start), RowSegment(num_tokens, tail_rows)]


class TransferSender:
    def __init__(self, sock: zmq.asyncio.Socket, transport: Transport, metrics: TransferMetrics, timeout: float):
        self.sock, self.transport, self.metrics, self.timeout = sock, transport, metrics, timeout
        self.replies = Framer(TransferFailed | Pong)
        self.transfers: dict[Key, OutgoingTransfer] = {}
        self.aborted: dict[Key, float] = {}  # aborted before (or while) we held them: until when
        # A write into the receiver's blocks may still land (its writer stopped answering): an abort is not
        # acknowledged, the receiver's quarantine frees the blocks. Until when.
        self.unsettled: dict[Key, float] = {}
        # Transfers whose rows are being written before they are held (a prefill engine writes them as it
        # computes the prompt): done once none is; an abort is acknowledged only then.
        self.settling: dict[Key, asyncio.Future] = {}
        self.rows_given: dict[Key, asyncio.Future] = {}  # runs asked of receivers (`ask_rows`), not given yet

    async def reply(self, peer: bytes, msg) -> None:
        await self.sock.send_multipart([peer, *self.replies.encode(msg)])

    async def fail(self, key: Key, message: str, status: int = 503) -> None:
        """The receiver learns the transfer failed (and frees its blocks); what it held is released."""
        self.end(key)
        await self.reply(key[0], TransferFailed(key[1], key[2], message, status))

    def hold(self, transfer: OutgoingTransfer) -> bool:
        """From here on `end` releases what the transfer holds; False if the receiver already aborted it."""
        if transfer.key in self.aborted:
            return False
        transfer.touched = time.monotonic()
        self.transfers[transfer.key] = transfer
        return True

    async def send_chunk(self, transfer: OutgoingTransfer, start: int, block_ids: list[int]) -> None:
        transfer.touched = time.monotonic()
        prompt = transfer.prompt
        total = prompt.num_tokens
        if not 0 <= start < total or not block_ids:
            raise VlserveError(f"the receiver offered no room (start {start} of {total} tokens)")
        row_map = RowMap(prompt.mm_items, transfer.every_token, transfer.tail_rows)
        end = row_map.chunk_end(start, len(block_ids) * transfer.block_tokens, total)
        n = end - start
        if transfer.write_rows is not None:  # the rows are written by the engine process
            segments, rows = every_token_segments(start, end, total, transfer.tail_rows), torch.empty(0, 0)
        else:
            segments, rows = await in_thread(transfer.rows_of, start, end)  # gathers a chunk's rows: a copy
        data = ChunkData(torch.tensor(prompt.prompt_token_ids[start:end], dtype=torch.int64),
                         prompt.positions[:, start:end].T.contiguous(), rows)
        items = [ItemMeta(it.offset, it.num_tokens, tuple(it.layout), it.mm_hash, it.modality)
                 for it in prompt.mm_items]
        peer, request_id, transfer_id = transfer.key
        header = TransferChunk(request_id, transfer_id, start, n, total, prompt.position_delta, items, block_ids,
                               segments, partial=end < total, handoff=None if end < total else transfer.handoff)
        if transfer.key not in self.transfers or transfer.key in self.aborted:
            self.end(transfer.key)
            return  # aborted meanwhile: its blocks may already be someone else's
        self.metrics.state(TransferState.TRANSFERRING)
        transfer.sending = asyncio.get_running_loop().create_future()
        try:
            if transfer.write_rows is None:
                self.metrics.bytes(await self.transport.send(self.sock, peer, header, data, transfer.target))
            else:
                written = await transfer.write_rows(start, end, block_ids)
                await self.transport.send_header(self.sock, peer, header, data)
                self.metrics.bytes(written + data.nbytes)
        finally:
            transfer.sending.set_result(None)
        if header.partial:
            self.metrics.resume()
        else:
            self.metrics.state(TransferState.SUCCESS)
            self.end(transfer.key)

    async def ask_rows(self, key: Key, num_rows: int) -> list[int]:
        """A run of the receiver's blocks for `num_rows` more rows (RowsWanted -> RowsGiven), within the timeout."""
        given = self.rows_given[key] = asyncio.get_running_loop().create_future()
        self.metrics.resume()
        try:
            await self.reply(key[0], RowsWanted(key[1], key[2], num_rows))
            async with asyncio.timeout(self.timeout):
                return await given
        except TimeoutError:
            raise VlserveError(f"the receiver gave no blocks for {num_rows} more rows within {self.timeout:g}s") \
                from None
        finally:
            self.rows_given.pop(key, None)

    def given(self, peer: bytes, msg: RowsGiven) -> None:
        """A receiver's run for `ask_rows` (one nobody waits for any more is dropped: its transfer failed or was
        aborted, and the receiver frees the run with it)."""
        future = self.rows_given.get((peer, msg.request_id, msg.transfer_id))
        if future is not None and not future.done():
            future.set_result(list(msg.block_ids))

    async def resume(self, peer: bytes, msg: ResumeRequest) -> None:
        key = (peer, msg.request_id, msg.transfer_id)
        transfer = self.transfers.get(key)
        if transfer is None:
            await self.reply(peer, TransferFailed(msg.request_id, msg.transfer_id, "nothing to resume (expired?)"))
            return
        try:
            await self.send_chunk(transfer, msg.start_token, msg.block_ids)
        except Exception as e:  # noqa: BLE001 - e.g. a bad start offset from the receiver
            self.metrics.state(TransferState.FAILED)
            await self.fail(key, f"resume failed: {e}")

    async def abort(self, peer: bytes, msg: AbortTransfer) -> None:
        """Nothing more is written for this transfer. A transport that writes the receiver's blocks itself then
        says so (TransferFailed "aborted"), once any write in flight has landed: only then may the receiver
        give those blocks to another request."""
        key = (peer, msg.request_id, msg.transfer_id)
        self.aborted[key] = time.monotonic() + self.timeout
        transfer = self.transfers.get(key)
        self.end(key)
        if transfer is not None and transfer.sending is not None:
            await asyncio.shield(transfer.sending)
        if (settling := self.settling.get(key)) is not None:
            await asyncio.shield(settling)
        if key in self.unsettled:
            logger.warning("transfer %s: a write into the receiver's blocks may still land; its abort is not "
                           "acknowledged (the receiver's quarantine frees them)", key[1][:64])
            return
        await self.reply(peer, TransferFailed(msg.request_id, msg.transfer_id, "aborted", ABORT_ACK_STATUS))

    def unsettle(self, key: Key) -> None:
        """A write for this transfer may still land in the receiver's blocks (see `unsettled`)."""
        self.unsettled[key] = time.monotonic() + quarantine_s()

    def end(self, key: Key) -> None:
        """The transfer is over (sent, failed, aborted or expired): what it holds is released."""
        transfer = self.transfers.pop(key, None)
        if transfer is not None and transfer.on_end is not None:
            transfer.on_end()

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            self.aborted = {k: until for k, until in self.aborted.items() if until > now}
            self.unsettled = {k: until for k, until in self.unsettled.items() if until > now}
            for key in [k for k, t in self.transfers.items() if now - t.touched > self.timeout]:
                logger.warning("transfer %s expired before the receiver resumed it", key[1][:64])
                self.metrics.state(TransferState.FAILED)
                self.end(key)


class SenderService:
    """The control loop of a sending role (encode, prefill): a ROUTER socket receivers connect to, each message
    handled in its own task, transfers through one `TransferSender`. A role says what it produces (`pong`) and
    how it answers a request (`on_request`)."""

    def _setup(self, host: str, data_port: int, auth: PeerAuth, transport: Transport, metrics: TransferMetrics,
               timeout: float, failure_prob: float = 0.0) -> None:
        self.host, self.data_port, self.auth = host, data_port, auth
        self.failure_prob, self.rng = failure_prob, random.Random()
        self.transport, self.metrics, self.timeout = transport, metrics, timeout
        self.framer = Framer(ReceiverToSender)
        self.sender: TransferSender | None = None  # once bound
        self.tasks: set[asyncio.Task] = set()
        self.boot = secrets.token_hex(8)  # in every Pong: a receiver sees this process restarted at its address

    def bind(self) -> None:
        """Bound before registering, so a receiver that finds us can connect at once."""
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.auth.secure_server(self.sock)
        self.sock.bind(f"tcp://{self.host}:{self.data_port or '*'}")  # 0: a free port, read back
        if not self.data_port:
            self.data_port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.sender = TransferSender(self.sock, self.transport, self.metrics, self.timeout)

    async def serve(self) -> None:
        sweeper = asyncio.create_task(self.sender.expire_loop())
        try:
            while True:
                peer, *frames = await self.sock.recv_multipart()
                try:
                    msg = self.framer.decode(frames)
                except Exception as e:  # noqa: BLE001 - a bad peer must not stop the service
                    logger.warning("dropped an undecodable message: %s", e)
                    continue
                self._dispatch(peer, msg)
        finally:
            sweeper.cancel()
            self.sock.close(linger=0)

    async def run(self, app, port: int, log_level: str, stop: asyncio.Event | None = None) -> None:
        """The data socket, and `app` (/health, /ready, /metrics) over HTTP on `port`, until the process is
        stopped or `stop` is set (its engine died)."""
        import uvicorn

        from vlserve.core.http_protocol import http_protocol

        data = asyncio.create_task(self.serve())
        http = uvicorn.Server(uvicorn.Config(app, host=self.host, port=port, log_level=log_level.lower(),
                                             access_log=False, log_config=None, http=http_protocol(None)))

        async def stop_when_set() -> None:
            await stop.wait()
            http.should_exit = True

        watch = asyncio.create_task(stop_when_set()) if stop is not None else None
        try:
            await http.serve()
        finally:
            data.cancel()
            if watch is not None:
                watch.cancel()
            for task in list(self.tasks):
                task.cancel()

    def _dispatch(self, peer: bytes, msg) -> None:
        if isinstance(msg, Ping):
            pong = self.pong(msg.nonce)
            pong.boot, pong.protocol = self.boot, PROTOCOL
            self.spawn(self.sender.reply(peer, pong))
        elif isinstance(msg, TransferRequest):
            self.on_request(peer, msg)
        elif isinstance(msg, ResumeRequest):
            self.spawn(self.sender.resume(peer, msg))
        elif isinstance(msg, RowsGiven):
            self.sender.given(peer, msg)
        elif isinstance(msg, AbortTransfer):
            self.on_abort((peer, msg.request_id, msg.transfer_id))
            self.spawn(self.sender.abort(peer, msg))

    def start_request(self, req: TransferRequest) -> dict:
        """The prompt a request names, after the fault injection of --transfer-failure-prob."""
        if self.failure_prob and self.rng.random() < self.failure_prob:
            raise VlserveError(f"injected transfer failure ({FAILURE_PROB_ENV} / --transfer-failure-prob)")
        prompt = {"prompt": req.prompt, "multi_modal_data": req.media}
        if any(any(v) for v in req.uuids.values()):
            prompt["multi_modal_uuids"] = req.uuids
        return prompt

    async def request_failed(self, key: Key, error: Exception) -> None:
        """Every failure reaches the receiver, which frees its blocks: the request's own fault with its 4xx,
        anything else as a 503 (with a traceback when it is not one of ours)."""
        status = getattr(error, "http_status", 400) if isinstance(error, InvalidInputError) else 503
        self.metrics.state(TransferState.REJECTED if status < 500 else TransferState.FAILED)
        if status >= 500 and not isinstance(error, VlserveError):
            logger.error("request %s failed", key[1][:128], exc_info=error)
        await self.sender.fail(key, str(error), status)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def pong(self, nonce: int) -> Pong:
        raise NotImplementedError

    def on_request(self, peer: bytes, msg: TransferRequest) -> None:
        raise NotImplementedError

    def on_abort(self, key: Key) -> None:
        """Before the sender drops the transfer: stop work still under way for it."""
