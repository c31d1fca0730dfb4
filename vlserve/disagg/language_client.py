"""The language server's side of disaggregation: find encoders, send them prompts with media, receive the
rows into block buffers (resuming when they outgrow the first allocation), and build the engine request.

A transfer goes Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed. Every block it holds is
freed on every exit path (success, failure, timeout, cancellation by a disconnected client). An encoder that
fails, dies or times out gets the request retried once on another encoder; then the error is a clear 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import blake3
import torch
import zmq
import zmq.asyncio

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError, ServiceUnavailableError
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.bootstrap import BootstrapClient, InstanceInfo
from vlserve.disagg.buffers import EmbeddingBuffers
from vlserve.disagg.messages import (
    AbortTransfer,
    EncodeRequest,
    Ping,
    Pong,
    ResumeRequest,
    TransferChunk,
    TransferFailed,
    TransferState,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.transport import TRANSPORTS, Codec
from vlserve.engine.config import VlserveConfig

logger = logging.getLogger("vlserve.disagg")
AFFINITY_ENTRIES = 4096


class EncoderFailure(Exception):
    """This encoder could not deliver (it failed, died or timed out): worth one retry elsewhere."""


@dataclass
class EncoderConn:
    info: InstanceInfo
    sock: zmq.asyncio.Socket
    in_flight: int = 0
    last_used: float = 0.0  # ties on load go to the encoder idle longest, so sequential work spreads too
    missed: int = 0
    alive: bool = True
    transfers: dict[tuple[str, int], asyncio.Queue] = field(default_factory=dict)
    reader: asyncio.Task | None = None


class DisaggClient:
    def __init__(self, cfg: VlserveConfig, buffers: EmbeddingBuffers, metrics: TransferMetrics, opts: DisaggArgs,
                 self_info: InstanceInfo):
        self.cfg, self.buffers, self.metrics, self.opts = cfg, buffers, metrics, opts
        self.transport = TRANSPORTS[opts.transfer_backend]()
        self.codec = Codec()
        self.ctx = zmq.asyncio.Context.instance()
        self.encoders: dict[str, EncoderConn] = {}
        self.affinity: OrderedDict[str, str] = OrderedDict()  # media key -> encoder id that saw it
        self.dropped: dict[str, float] = {}  # encoder id -> when we dropped it
        self.auth = PeerAuth(opts.disagg_secret)
        require_secret_off_loopback(self.auth, opts.bootstrap.rsplit(":", 1)[0], "this language server's registry")
        self.bootstrap = BootstrapClient(opts.bootstrap, self_info, opts.heartbeat_interval,
                                         load_fn=lambda: sum(e.in_flight for e in self.encoders.values()),
                                         auth=self.auth)
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._block_freed = asyncio.Event()

    async def start(self) -> None:
        await self.bootstrap.start()
        await self._refresh()
        self._tasks = [asyncio.create_task(self._refresh_loop()), asyncio.create_task(self._ping_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for enc in list(self.encoders.values()):
            self._drop(enc, "shutting down")
        await self.bootstrap.stop()

    # ---- membership and heartbeats ----------------------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opts.heartbeat_interval)
            try:
                await self._refresh()
            except Exception as e:  # noqa: BLE001 - the registry may be restarting; keep the encoders we know
                logger.warning("could not list encoders: %s", e)

    async def _refresh(self) -> None:
        """The registry is for discovery only: an encoder is dropped when it stops answering our pings, not
        when the registry loses sight of it (a slow heartbeat or a registry restart must not cut live work)."""
        listed = {i.instance_id: i for i in await self.bootstrap.list_instances("encode")}
        # A dead encoder stays listed until the registry times it out too: do not reconnect to it meanwhile.
        # One still heartbeating to the registry long after we dropped it is alive after all: take it back.
        quarantine = 2 * self.opts.heartbeat_failure_threshold * self.opts.heartbeat_interval
        now = time.monotonic()
        self.dropped = {iid: t for iid, t in self.dropped.items() if now - t < quarantine}
        for iid, info in listed.items():
            if iid not in self.encoders and iid not in self.dropped:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                self.auth.secure_client(sock)
                sock.connect(f"tcp://{info.address}")
                enc = EncoderConn(info, sock)
                enc.reader = asyncio.create_task(self._read(enc))
                self.encoders[iid] = enc
                logger.info("encoder %s joined (%s)", iid[:8], info.address)

    async def _ping_loop(self) -> None:
        nonce = itertools.count()
        while True:
            await asyncio.sleep(self.opts.heartbeat_interval)
            for enc in list(self.encoders.values()):
                enc.missed += 1
                if enc.missed > self.opts.heartbeat_failure_threshold:
                    self._drop(enc, f"missed {enc.missed - 1} heartbeats")
                    continue
                await enc.sock.send(self.codec.enc.encode(Ping(next(nonce))))

    def _drop(self, enc: EncoderConn, why: str) -> None:
        if self.encoders.pop(enc.info.instance_id, None) is None:
            return
        enc.alive = False
        self.dropped[enc.info.instance_id] = time.monotonic()
        logger.warning("encoder %s (%s) dropped: %s", enc.info.instance_id[:8], enc.info.address, why)
        for q in enc.transfers.values():
            q.put_nowait(EncoderFailure(f"encoder {enc.info.address} {why}"))
        if enc.reader is not None:
            enc.reader.cancel()
        enc.sock.close(linger=0)

    async def _read(self, enc: EncoderConn) -> None:
        while True:
            frames = await enc.sock.recv_multipart()
            try:
                msg = self.codec.to_language.decode(frames[0])
            except Exception as e:  # noqa: BLE001
                logger.warning("undecodable message from encoder %s: %s", enc.info.address, e)
                continue
            enc.missed = 0  # any message proves it is alive
            if isinstance(msg, Pong):
                continue
            q = enc.transfers.get((msg.request_id, msg.transfer_id))
            if q is not None:
                q.put_nowait((msg, frames[1:]))

    # ---- transfers ---------------------------------------------------------------------------------------------
    def _pick(self, key: str, exclude: set[str]) -> EncoderConn | None:
        live = [e for e in self.encoders.values() if e.alive and e.info.instance_id not in exclude]
        if not live:
            return None
        least = min(e.in_flight for e in live)
        preferred = self.affinity.get(key)
        for e in live:  # the encoder that saw this media has it cached, unless it is much busier
            if e.info.instance_id == preferred and e.in_flight <= least + 1:
                return e
        return min(live, key=lambda e: (e.in_flight, e.last_used))

    async def encode(self, request_id: str, prompt: str, media: dict, uuids: dict, mm_kwargs: dict) -> ProcessedPrompt:
        key = _media_key(media)
        tried: set[str] = set()
        last: Exception | None = None
        for _ in range(2):  # the first try and one retry on another encoder
            enc = self._pick(key, tried)
            if enc is None:
                break
            tried.add(enc.info.instance_id)
            try:
                req = await self._transfer(enc, request_id, prompt, media, uuids, mm_kwargs)
                self.affinity[key] = enc.info.instance_id
                self.affinity.move_to_end(key)
                while len(self.affinity) > AFFINITY_ENTRIES:
                    self.affinity.popitem(last=False)
                return req
            except EncoderFailure as e:
                retry = len(tried) < 2 and self._pick(key, tried) is not None
                logger.warning("request %s: encoder %s failed (%s)%s", request_id, enc.info.address, e,
                               "; retrying on another encoder" if retry else "")
                last = e
        if last is None:
            raise ServiceUnavailableError("no encoder is available for a request with media; retry later")
        raise ServiceUnavailableError(f"encoding failed after {len(tried)} attempt(s): {last}")

    async def _allocate(self, tokens: int) -> list[int]:
        deadline = time.monotonic() + self.opts.transfer_timeout
        while True:
            blocks = self.buffers.allocate(tokens)
            if blocks is not None:
                return blocks
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("the embedding receive buffer stayed full; retry later")
            self._block_freed.clear()
            try:
                await asyncio.wait_for(self._block_freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _free(self, blocks: list[int]) -> None:
        if blocks:
            self.buffers.free(blocks)
            self._block_freed.set()

    async def _transfer(self, enc: EncoderConn, request_id: str, prompt: str, media: dict, uuids: dict,
                        mm_kwargs: dict) -> ProcessedPrompt:
        tid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        enc.transfers[(request_id, tid)] = queue
        enc.in_flight += 1
        enc.last_used = time.monotonic()
        enter = self._state_logger(request_id, tid, enc)
        enter(TransferState.BOOTSTRAPPING)
        t0 = time.perf_counter()
        blocks: list[int] = []
        pieces: list = []  # rows kept from earlier (partial) chunks
        try:
            blocks = await self._allocate(self.opts.embedding_default_allocate_tokens)
            await enc.sock.send(self.codec.enc.encode(EncodeRequest(
                request_id, tid, prompt, media, uuids, mm_kwargs or {}, blocks, self.buffers.spec.block_tokens)))
            enter(TransferState.WAITING_FOR_INPUT)
            while True:
                try:
                    got = await asyncio.wait_for(queue.get(), self.opts.transfer_timeout)
                except asyncio.TimeoutError:
                    raise EncoderFailure(f"no answer within {self.opts.transfer_timeout:.0f}s") from None
                if isinstance(got, Exception):
                    raise got
                msg, frames = got
                if isinstance(msg, TransferFailed):
                    if msg.status == 400:
                        raise InvalidInputError(msg.message)
                    raise EncoderFailure(msg.message)
                header: TransferChunk = msg
                enter(TransferState.TRANSFERRING)
                rows = self.transport.read_chunk(header, frames)
                self.buffers.scatter(blocks, 0, rows.embeddings, rows.fill_ids, rows.positions)
                self.metrics.bytes(sum(t.numel() * t.element_size() for t in (rows.embeddings, rows.fill_ids,
                                                                               rows.positions)))
                # Keep what arrived, give back its blocks, and take fresh ones for the rest.
                pieces.append(self.buffers.gather(blocks, 0, header.num_tokens))
                self._free(blocks)
                blocks = []
                sent = header.start_token + header.num_tokens
                if not header.partial:
                    enter(TransferState.SUCCESS)
                    self.metrics.transfer_latency.observe(time.perf_counter() - t0)
                    return self._assemble(prompt, header, pieces)
                self.metrics.resume()
                blocks = await self._allocate(header.total_tokens - sent)
                await enc.sock.send(self.codec.enc.encode(ResumeRequest(request_id, tid, sent, blocks)))
        except BaseException:
            enter(TransferState.FAILED)
            if enc.alive:  # let the encoder drop what it staged for us
                await enc.sock.send(self.codec.enc.encode(AbortTransfer(request_id, tid)))
            raise
        finally:
            self._free(blocks)
            enc.in_flight -= 1
            enc.transfers.pop((request_id, tid), None)

    def _state_logger(self, request_id: str, tid: int, enc: EncoderConn):
        """Counts each state in the metrics and shows the transitions in debug logs."""
        def enter(state: TransferState) -> None:
            self.metrics.state(state)
            logger.debug("transfer %s/%d via %s: %s", request_id, tid, enc.info.address, state.value)
        return enter

    def _assemble(self, prompt: str, header: TransferChunk, pieces: list) -> ProcessedPrompt:
        emb = torch.cat([p[0] for p in pieces])
        fill_ids = torch.cat([p[1] for p in pieces]).tolist()
        positions = torch.cat([p[2] for p in pieces], dim=1)
        if len(fill_ids) != header.total_tokens:
            raise EncoderFailure(f"received {len(fill_ids)} of {header.total_tokens} tokens")
        items = [MultiModalItem(it.offset, it.num_tokens, None, tuple(it.grid_thw), it.mm_hash,
                                emb[it.offset:it.offset + it.num_tokens].clone()) for it in header.items]
        return ProcessedPrompt(fill_ids, items, positions, header.mrope_delta, prompt)


def _media_key(media: dict) -> str:
    """Affinity key from the media as sent (URLs or data URLs): the same picture goes to the same encoder."""
    h = blake3.blake3()
    for kind in sorted(media):
        for src in media[kind]:
            h.update(f"{kind}|{src if isinstance(src, str) else repr(src)[:256]}|".encode())
    return h.hexdigest(length=16)


def make_language_client(engine, opts: DisaggArgs, http_address: str) -> DisaggClient:
    """Buffers sized for this model, transfer metrics on the server's registry, registered as a language server."""
    from vlserve.disagg.bootstrap import new_instance_id
    from vlserve.disagg.buffers import BufferSpec

    cfg = engine.cfg
    buffers = EmbeddingBuffers(BufferSpec(opts.embedding_block_tokens, cfg.model.text.hidden_size, cfg.dtype),
                              opts.embedding_buffer_blocks)
    metrics = TransferMetrics(engine.metrics.registry, buffers, "language")
    info = InstanceInfo(new_instance_id(), "language", http_address, http_address)
    client = DisaggClient(cfg, buffers, metrics, opts, info)
    engine.metrics.registry.register(_EncoderGauge(client))
    return client


class _EncoderGauge:
    def __init__(self, client: DisaggClient):
        self.client = client

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("vlserve:encoders_available", "Encoders this language server can send work to.")
        g.add_metric([], float(sum(e.alive for e in self.client.encoders.values())))
        yield g
