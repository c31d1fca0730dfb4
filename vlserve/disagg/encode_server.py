"""`vlserve encode`: a vision-encoder service. Language servers send it prompts with media; it fetches,
preprocesses, tokenizes, runs the ViT and writes the per-token rows into the receiver's blocks, chunk by chunk
when the receiver's blocks are too few (resume). Its own output waits in its own block pool until sent."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vlserve.core.config import Options
from vlserve.core.errors import InvalidInputError, VlserveError
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.buffers import BufferSpec, EmbeddingBuffers
from vlserve.disagg.encoder_worker import EncodedPrompt, EncoderWorker
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
from vlserve.disagg.transport import TRANSPORTS, Codec, Rows
from vlserve.frontend.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import CONTENT_TYPE, PREFIX

logger = logging.getLogger("vlserve.encode")
FAILURE_PROB_ENV = "VLSERVE_TRANSFER_FAILURE_PROB"


@dataclass
class _Pending:
    """Encoder output staged in our blocks while the receiver makes room for the rest."""

    blocks: list[int]
    out: EncodedPrompt
    touched: float
    receiver_block_tokens: int


class EncodeServer:
    def __init__(self, worker: EncoderWorker, opts: Options):
        self.worker, self.opts, d = worker, opts.disagg, opts.disagg
        self.host, self.data_port = opts.server.host, d.data_port or opts.server.port + 1
        self.failure_prob, self.rng = d.transfer_failure_prob, random.Random()
        self.auth = PeerAuth(d.disagg_secret)
        require_secret_off_loopback(self.auth, self.host, "this encoder")
        self.buffers = EmbeddingBuffers(BufferSpec(d.embedding_block_tokens, worker.hidden, worker.dtype),
                                        d.embedding_buffer_blocks)
        self.registry = CollectorRegistry()
        self.metrics = TransferMetrics(self.registry, self.buffers, "encode")
        self.registry.register(_EncoderStats(self))
        self.transport = TRANSPORTS[d.transfer_backend]()
        self.codec = Codec()
        self.fetchers = {kind: MediaFetcher(MediaPolicy.from_args(opts.server, kind)) for kind in ("image", "video")}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-vit")  # one ViT at a time
        self.pending: dict[tuple[bytes, str, int], _Pending] = {}
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    # ---- control loop ------------------------------------------------------------------------------------
    def bind(self) -> None:
        """Bound before registering, so a language server that finds us can connect at once."""
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.auth.secure_server(self.sock)
        self.sock.bind(f"tcp://{self.host}:{self.data_port}")

    async def serve_zmq(self) -> None:
        sweeper = asyncio.create_task(self._expire_pending())
        try:
            while True:
                peer, *frames = await self.sock.recv_multipart()
                try:
                    msg = self.codec.to_encoder.decode(frames[0])
                except Exception as e:  # noqa: BLE001 - a bad peer must not stop the service
                    logger.warning("dropped an undecodable message: %s", e)
                    continue
                self._dispatch(peer, msg)
        finally:
            sweeper.cancel()
            self.sock.close(linger=0)

    def _dispatch(self, peer: bytes, msg) -> None:
        if isinstance(msg, Ping):
            self._spawn(self._send(peer, Pong(msg.nonce, self.in_flight)))
        elif isinstance(msg, EncodeRequest):
            self._spawn(self._encode(peer, msg))
        elif isinstance(msg, ResumeRequest):
            self._spawn(self._resume(peer, msg))
        elif isinstance(msg, AbortTransfer):
            self._drop((peer, msg.request_id, msg.transfer_id))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, peer: bytes, msg) -> None:
        await self.sock.send_multipart([peer, self.codec.enc.encode(msg)])

    # ---- one transfer --------------------------------------------------------------------------------------
    async def _encode(self, peer: bytes, req: EncodeRequest) -> None:
        self.in_flight += 1
        self.metrics.state(TransferState.WAITING_FOR_INPUT)
        try:
            if self.failure_prob and self.rng.random() < self.failure_prob:
                raise VlserveError(f"injected transfer failure ({FAILURE_PROB_ENV} / --transfer-failure-prob)")
            media = {kind: [await self._fetch(kind, src) for src in items] for kind, items in req.media.items()}
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(self.executor, self.worker.encode, req.prompt, media, req.uuids,
                                             req.mm_processor_kwargs)
            blocks = self.buffers.allocate(out.num_tokens)
            if blocks is None:
                raise VlserveError("the encoder's staging buffer is full; retry later")
            key = (peer, req.request_id, req.transfer_id)
            self.pending[key] = _Pending(blocks, out, time.monotonic(), req.block_tokens)  # _drop frees it
            self.buffers.scatter(blocks, 0, out.embeddings, out.fill_ids, out.positions)
            await self._send_chunk(peer, key, 0, req.block_ids, req.block_tokens)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the receiver, which frees its blocks
            self._drop((peer, req.request_id, req.transfer_id))
            self.metrics.state(TransferState.FAILED)
            status = 400 if isinstance(e, InvalidInputError) else 503
            if status == 503 and not isinstance(e, VlserveError):
                logger.exception("encoding %s failed", req.request_id)
            await self._send(peer, TransferFailed(req.request_id, req.transfer_id, str(e), status))
        finally:
            self.in_flight -= 1

    async def _fetch(self, kind: str, src):
        if isinstance(src, str) and not src.startswith("data:"):
            return await self.fetchers[kind].fetch(src)
        return src  # data URLs and embedding entries are read by the input processor

    async def _resume(self, peer: bytes, msg: ResumeRequest) -> None:
        key = (peer, msg.request_id, msg.transfer_id)
        if key not in self.pending:
            await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, "nothing to resume (expired?)"))
            return
        try:
            await self._send_chunk(peer, key, msg.start_token, msg.block_ids, self.pending[key].receiver_block_tokens)
        except Exception as e:  # noqa: BLE001 - e.g. a bad start offset from the receiver
            self._drop(key)
            self.metrics.state(TransferState.FAILED)
            await self._send(peer, TransferFailed(msg.request_id, msg.transfer_id, f"resume failed: {e}"))

    async def _send_chunk(self, peer: bytes, key, start: int, block_ids: list[int], block_tokens: int) -> None:
        p = self.pending[key]
        p.touched = time.monotonic()
        total = p.out.num_tokens
        n = min(total - start, len(block_ids) * block_tokens)
        if n <= 0:
            raise VlserveError(f"the receiver offered no room (start {start} of {total} tokens)")
        emb, ids, pos = self.buffers.gather(p.blocks, start, n)
        partial = start + n < total
        header = TransferChunk(key[1], key[2], start, n, total, p.out.mrope_delta, p.out.items, block_ids, partial,
                               str(emb.dtype).removeprefix("torch."), emb.shape[1])
        self.metrics.state(TransferState.TRANSFERRING)
        self.metrics.bytes(await self.transport.send_chunk(self.sock, peer, header, Rows(emb, ids, pos)))
        if partial:
            self.metrics.resume()
        else:
            self.metrics.state(TransferState.SUCCESS)
            self._drop(key)

    def _drop(self, key) -> None:
        p = self.pending.pop(key, None)
        if p is not None:
            self.buffers.free(p.blocks)

    async def _expire_pending(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key in [k for k, p in self.pending.items() if now - p.touched > self.opts.transfer_timeout]:
                logger.warning("transfer %s expired before the receiver resumed it", key[1])
                self.metrics.state(TransferState.FAILED)
                self._drop(key)

    # ---- HTTP side ---------------------------------------------------------------------------------------
    def http_app(self) -> FastAPI:
        app = FastAPI(title="vlserve encode")

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

        return app


class _EncoderStats:
    """Encoder-cache counters and load of an encode server, read at scrape time."""

    def __init__(self, server: EncodeServer):
        self.server = server

    def collect(self):
        w = self.server.worker
        for name, value, help_text in (
                ("encoder_cache_queries_total", w.cache_queries, "Media items looked up in the encoder cache."),
                ("encoder_cache_hits_total", w.cache_hits, "Media items served from the encoder cache.")):
            c = CounterMetricFamily(PREFIX + name, help_text)
            c.add_metric([], float(value))
            yield c
        g = GaugeMetricFamily(PREFIX + "encode_requests_in_flight", "Encode requests being worked on.")
        g.add_metric([], float(self.server.in_flight))
        yield g


async def run_encoder(opts: Options, log_level: str) -> None:
    """The encode role: bind the data socket, register with the bootstrap, serve until stopped."""
    import uvicorn

    from vlserve.disagg.bootstrap import BootstrapClient, InstanceInfo, new_instance_id

    server = EncodeServer(EncoderWorker(opts.engine), opts)
    server.bind()
    host, port = opts.server.host, opts.server.port
    info = InstanceInfo(new_instance_id(), "encode", f"{host}:{server.data_port}", f"{host}:{port}")
    boot = BootstrapClient(opts.disagg.bootstrap, info, opts.disagg.heartbeat_interval,
                           load_fn=lambda: server.in_flight, auth=server.auth)
    zmq_task = asyncio.create_task(server.serve_zmq())
    await boot.start()
    logger.info("encoder ready: data tcp://%s, http://%s", info.address, info.http_address)
    http = uvicorn.Server(uvicorn.Config(server.http_app(), host=host, port=port, log_level=log_level.lower(),
                                         access_log=False, log_config=None))
    try:
        await http.serve()
    finally:
        zmq_task.cancel()
        await boot.stop()
        server.auth.stop()
