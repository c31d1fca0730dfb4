"""`vlserve encode`: a vision-encoder service built from the engine's own parts.

A language server sends a prompt with media and the ids of its receive blocks. The service:
- fetches the media under its own URL policy and turns the prompt into a `ProcessedPrompt` with the same
  `LocalPromptEncoder` an aggregated server uses (decoding, preprocessing, tokenizing, placeholder expansion,
  M-RoPE positions, every size limit);
- runs the vision tower with the engine's `VisionRunner`, deciding what to run and what to keep with the
  engine's `EncoderCacheManager` (keyed by mm_hash): a picture seen before is not encoded again;
- writes, chunk by chunk, each token's fill id and positions and each media token's embedding row into the
  receiver's blocks through the transport. Text tokens never carry a row. When the receiver's blocks run out it
  asks to resume; meanwhile the rows wait in the encoder cache, held for that transfer (no staging copy).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vlserve.core.config import Options
from vlserve.core.errors import InvalidInputError, ServiceUnavailableError, VlserveError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.wire import Framer
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.messages import (
    AbortTransfer,
    EncodeRequest,
    ItemMeta,
    LanguageToEncoder,
    Ping,
    Pong,
    ResumeRequest,
    RowSegment,
    TransferChunk,
    TransferFailed,
    TransferState,
    TransferTarget,
)
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.transports import TRANSPORTS, ChunkData
from vlserve.disagg.transports.base import ABORT_ACK_STATUS, reachable_host
from vlserve.engine.config import resolve_config
from vlserve.engine.encoder_cache import EncoderCacheManager
from vlserve.engine.vision_runner import VisionRunner
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import CONTENT_TYPE, PREFIX
from vlserve.frontend.prompt_encoder import LocalPromptEncoder
from vlserve.model.hardware import log_once
from vlserve.model.layers.packed_linear import packed_linear_supported
from vlserve.model.loader import load_model

logger = logging.getLogger("vlserve.encode")
FAILURE_PROB_ENV = "VLSERVE_TRANSFER_FAILURE_PROB"


@dataclass
class _Transfer:
    """One prompt whose rows are being sent; its items stay held in the encoder cache until it ends."""

    key: tuple[bytes, str, int]  # (peer, request id, transfer id)
    prompt: ProcessedPrompt
    rows: list[torch.Tensor]  # per media item [num_tokens, width]: the encoder cache's own tensors, not copies
    block_tokens: int
    touched: float
    target: TransferTarget | None = None  # where the receiver's blocks are, for transports that write them
    sending: asyncio.Future | None = None  # done when no write into the receiver's blocks is in flight

    @property
    def holder(self) -> str:
        return f"{self.key[1]}/{self.key[2]}/{self.key[0].hex()}"


class EncodeService:
    def __init__(self, opts: Options):
        engine, server, d = opts.engine, opts.server, opts.disagg
        self.opts, self.d = opts, d
        self.cfg = resolve_config(engine)
        log_once()
        processor = InputProcessor.for_model(self.cfg, server.max_image_pixels)
        self.executor = ThreadPoolExecutor(max_workers=server.media_threads, thread_name_prefix="vlserve-media")
        fetchers = {kind: MediaFetcher(MediaPolicy.from_args(server, kind)) for kind in ("image", "video")}
        self.prompts = LocalPromptEncoder(processor, fetchers, self.executor)
        model = load_model(self.cfg.model_path, self.cfg.model, self.cfg.dtype, self.cfg.device, with_language=False,
                           quantization=self.cfg.quantization)
        if packed_linear_supported(self.cfg.device, self.cfg.dtype):
            model.pack_for_cpu()
        self.vision = VisionRunner(model, self.cfg.device)
        self.cache = EncoderCacheManager.for_model(self.cfg.encoder_cache_size, self.cfg.model)
        self.vit = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-vit")  # one vision call at a time
        self.encoding: dict[str, asyncio.Future] = {}  # mm_hash -> its vision call, while it runs
        self.width = self.cfg.model.embedding_width
        self.host, self.data_port = server.host, d.data_port or server.port + 1
        self.failure_prob, self.rng = d.transfer_failure_prob, random.Random()
        self.auth = PeerAuth(d.disagg_secret)
        require_secret_off_loopback(self.auth, self.host, "this encoder")
        self.transport = TRANSPORTS[d.transfer_backend](reachable_host(self.host, toward=d.bootstrap.rsplit(":", 1)[0]))
        self.framer = Framer(LanguageToEncoder)
        self.replies = Framer(TransferFailed | Pong)
        self.registry = CollectorRegistry()
        self.metrics = TransferMetrics(self.registry, None, "encode")
        self.registry.register(_EncoderStats(self))
        self.transfers: dict[tuple[bytes, str, int], _Transfer] = {}
        self.aborted: dict[tuple[bytes, str, int], float] = {}  # aborted before (or while) we held them: until when
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    # ---- control loop ------------------------------------------------------------------------------------
    def bind(self) -> None:
        """Bound before registering, so a language server that finds us can connect at once."""
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.auth.secure_server(self.sock)
        self.sock.bind(f"tcp://{self.host}:{self.data_port}")

    async def serve(self) -> None:
        sweeper = asyncio.create_task(self._expire())
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

    def _dispatch(self, peer: bytes, msg) -> None:
        if isinstance(msg, Ping):
            m = self.cfg.model
            self._spawn(self._send(peer, Pong(msg.nonce, self.in_flight, m.architecture, m.text.hidden_size,
                                              len(m.vision.deepstack_indexes))))
        elif isinstance(msg, EncodeRequest):
            self._spawn(self._encode(peer, msg))
        elif isinstance(msg, ResumeRequest):
            self._spawn(self._resume(peer, msg))
        elif isinstance(msg, AbortTransfer):
            self._spawn(self._abort(peer, msg))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, peer: bytes, msg) -> None:
        await self.sock.send_multipart([peer, *self.replies.encode(msg)])

    # ---- one transfer --------------------------------------------------------------------------------------
    async def _encode(self, peer: bytes, req: EncodeRequest) -> None:
        key = (peer, req.request_id, req.transfer_id)
        self.in_flight += 1
        self.metrics.state(TransferState.WAITING_FOR_INPUT)
        try:
            if self.failure_prob and self.rng.random() < self.failure_prob:
                raise VlserveError(f"injected transfer failure ({FAILURE_PROB_ENV} / --transfer-failure-prob)")
            prompt = {"prompt": req.prompt, "multi_modal_data": req.media}
            if any(any(v) for v in req.uuids.values()):
                prompt["multi_modal_uuids"] = req.uuids
            processed = (await self.prompts.encode(prompt, req.mm_processor_kwargs, req.request_id)).prompt
            if key in self.aborted:
                return
            transfer = _Transfer(key, processed, [], req.block_tokens, time.monotonic(), req.target)
            self.transfers[key] = transfer  # from here on, _end releases what it holds
            transfer.rows = await self._embeddings(transfer)
            await self._send_chunk(transfer, 0, req.block_ids)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the receiver, which frees its blocks
            self._end(key)
            status = e.http_status if isinstance(e, InvalidInputError) else 503
            self.metrics.state(TransferState.REJECTED if status < 500 else TransferState.FAILED)
            if status >= 500 and not isinstance(e, VlserveError):
                logger.exception("encoding %s failed", req.request_id)
            await self._send(peer, TransferFailed(req.request_id, req.transfer_id, str(e), status))
        finally:
            self.in_flight -= 1

    async def _embeddings(self, transfer: _Transfer) -> list[torch.Tensor]:
        """Each media item's rows: from the encoder cache, a vision call in flight, or a new one (batched)."""
        items, holder = transfer.prompt.mm_items, transfer.holder
        todo, waits = [], []
        for i, item in enumerate(items):
            if not item.needs_encoder:
                continue
            if self.cache.holds((holder, i), item) or self.cache.lookup((holder, i), item):
                if item.mm_hash in self.encoding:
                    waits.append(self.encoding[item.mm_hash])
                continue
            if not self.cache.can_allocate(item.num_tokens):
                raise ServiceUnavailableError("the encoder cache is full of pictures still being sent; retry later")
            self.vision.free(self.cache.allocate((holder, i), item))
            if item.mm_hash not in self.encoding:
                self.encoding[item.mm_hash] = asyncio.get_running_loop().create_future()
                todo.append(item)
        if todo:
            try:
                await asyncio.get_running_loop().run_in_executor(self.vit, self.vision.encode, todo)
            except BaseException as e:
                for item in todo:
                    self._finish_encoding(item.mm_hash, e)
                raise
            for item in todo:
                self._finish_encoding(item.mm_hash, None)
        for wait in waits:
            await asyncio.shield(wait)
        return [self.vision.outputs[it.mm_hash] if it.needs_encoder else it.embeddings for it in items]

    def _finish_encoding(self, mm_hash: str, error: BaseException | None) -> None:
        future = self.encoding.pop(mm_hash, None)
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(ServiceUnavailableError(f"the vision encoder failed: {error}"))

    async def _abort(self, peer: bytes, msg: AbortTransfer) -> None:
        """Nothing more is written for this transfer. A transport that writes the receiver's blocks itself then
        says so (TransferFailed "aborted"), once any write in flight has landed: only then may the receiver
        give those blocks to another request."""
        key = (peer, msg.request_id, msg.transfer_id)
        self.aborted[key] = time.monotonic() + self.d.transfer_timeout
        transfer = self.transfers.get(key)
        self._end(key)
        if transfer is not None and transfer.sending is not None:
            await asyncio.shield(transfer.sending)
        if self.transport.writes_in_place:
            await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, "aborted", ABORT_ACK_STATUS))

    async def _resume(self, peer: bytes, msg: ResumeRequest) -> None:
        key = (peer, msg.request_id, msg.transfer_id)
        transfer = self.transfers.get(key)
        if transfer is None:
            await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, "nothing to resume (expired?)"))
            return
        try:
            await self._send_chunk(transfer, msg.start_token, msg.block_ids)
        except Exception as e:  # noqa: BLE001 - e.g. a bad start offset from the receiver
            self._end(key)
            self.metrics.state(TransferState.FAILED)
            await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, f"resume failed: {e}"))

    async def _send_chunk(self, transfer: _Transfer, start: int, block_ids: list[int]) -> None:
        transfer.touched = time.monotonic()
        prompt = transfer.prompt
        total = prompt.num_tokens
        n = min(total - start, len(block_ids) * transfer.block_tokens)
        if n <= 0 or start < 0:
            raise VlserveError(f"the receiver offered no room (start {start} of {total} tokens)")
        end = start + n
        segments, rows = [], []
        for item, item_rows in zip(prompt.mm_items, transfer.rows):
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo < hi:
                segments.append(RowSegment(lo, hi - lo))
                rows.append(item_rows[lo - item.offset : hi - item.offset])
        data = ChunkData(torch.tensor(prompt.prompt_token_ids[start:end], dtype=torch.int64),
                         prompt.mrope_positions[:, start:end].T.contiguous(),
                         torch.cat(rows).cpu() if rows else torch.empty(0, self.width))
        items = [ItemMeta(it.offset, it.num_tokens, tuple(it.grid_thw), it.mm_hash) for it in prompt.mm_items]
        peer, request_id, transfer_id = transfer.key
        header = TransferChunk(request_id, transfer_id, start, n, total, prompt.mrope_delta, items, block_ids,
                               segments, partial=end < total)
        if transfer.key not in self.transfers or transfer.key in self.aborted:
            self._end(transfer.key)
            return  # aborted meanwhile: its blocks may already be someone else's
        self.metrics.state(TransferState.TRANSFERRING)
        transfer.sending = asyncio.get_running_loop().create_future()
        try:
            self.metrics.bytes(await self.transport.send(self.sock, peer, header, data, transfer.target))
        finally:
            transfer.sending.set_result(None)
        if header.partial:
            self.metrics.resume()
        else:
            self.metrics.state(TransferState.SUCCESS)
            self._end(transfer.key)

    def _end(self, key) -> None:
        """The transfer is over (sent, failed, aborted or expired): its items may leave the cache when unused."""
        transfer = self.transfers.pop(key, None)
        if transfer is not None:
            self.vision.free(self.cache.release_all(transfer.holder, transfer.prompt.mm_items))

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            self.aborted = {k: until for k, until in self.aborted.items() if until > now}
            for key in [k for k, t in self.transfers.items() if now - t.touched > self.d.transfer_timeout]:
                logger.warning("transfer %s expired before the receiver resumed it", key[1][:64])
                self.metrics.state(TransferState.FAILED)
                self._end(key)

    # ---- HTTP side ---------------------------------------------------------------------------------------
    def http_app(self) -> FastAPI:
        app = FastAPI(title="vlserve encode", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

        return app

    async def aclose(self) -> None:
        await self.prompts.stop()
        self.auth.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.vit.shutdown(wait=False, cancel_futures=True)


class _EncoderStats:
    """Encoder-cache counters, vision-call latency and load of an encode service, read at scrape time."""

    def __init__(self, service: EncodeService):
        self.service = service

    def collect(self):
        s = self.service
        for name, value, help_text in (
                ("encoder_cache_queries_total", s.cache.queries, "Media items looked up in the encoder cache."),
                ("encoder_cache_hits_total", s.cache.hits, "Media items served from the encoder cache.")):
            c = CounterMetricFamily(PREFIX + name, help_text)
            c.add_metric([], float(value))
            yield c
        for name, value, help_text in (
                ("encode_requests_in_flight", s.in_flight, "Encode requests being worked on."),
                ("encode_transfers_held", len(s.transfers), "Transfers whose items the encoder cache holds (being "
                 "sent or waiting for a resume)."),
                ("encoder_cache_used_tokens", s.cache.used,
                 "Embedding rows in the encoder cache (1 + DeepStack levels per media token).")):
            g = GaugeMetricFamily(PREFIX + name, help_text)
            g.add_metric([], float(value))
            yield g


async def run_encoder(opts: Options, log_level: str) -> None:
    """The encode role: bind the data socket, register with the bootstrap, serve until stopped."""
    import uvicorn

    from vlserve.disagg.bootstrap import BootstrapClient, InstanceInfo, new_instance_id

    service = EncodeService(opts)
    service.bind()
    host, port = opts.server.host, opts.server.port
    info = InstanceInfo(new_instance_id(), "encode", f"{host}:{service.data_port}", f"{host}:{port}")
    boot = BootstrapClient(opts.disagg.bootstrap, info, opts.disagg.heartbeat_interval,
                           load_fn=lambda: service.in_flight, auth=service.auth)
    zmq_task = asyncio.create_task(service.serve())
    await boot.start()
    logger.info("encoder ready: data tcp://%s, http://%s", info.address, info.http_address)
    http = uvicorn.Server(uvicorn.Config(service.http_app(), host=host, port=port, log_level=log_level.lower(),
                                         access_log=False, log_config=None))
    try:
        await http.serve()
    finally:
        zmq_task.cancel()
        await boot.stop()
        await service.aclose()
