"""`vlserve prefill`: a prefill instance of an E->P->D deployment.

A decode instance sends it a rendered prompt (with media URLs), the request's sampling parameters and the ids of
its receive blocks. The prefill instance has the prompt's media encoded by encoder services (embedding rows in
its own receive blocks, exactly like a language server), runs the prompt through its engine, samples the first
token as the whole request would, and writes every prompt token's KV row (engine.kv_handoff) into the decode
instance's blocks over the transport (a hybrid model's linear states follow as rows, engine.state_rows): once the
prompt's length is known it asks the decode instance for the blocks beyond its first run (`RowsWanted`), so that
its engine writes every row as it computes the prompt, each layer as soon as it ran (engine.kv_connector); one
chunk's header follows, with the first token and the random state. It speaks the peers' protocol
(disagg.messages) as the sender, with the same abort and expiry (disagg.sender).

A request may name the LoRA adapter the decode instance accepted it with (`--enable-lora` on both), by name and
content key, never by path: the prompt is computed with the adapter of that name this instance serves
(`--lora-modules`), if its key is the same, and its items keep the adapter's own hashes, so the KV the decode
instance receives is the adapter's, keyed as its prefix cache keys it. An instance that does not serve it (no
--enable-lora, no such adapter, other files under that name) refuses with a 503 naming itself, having read nothing:
the decode instance tries another.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time

from fastapi import FastAPI
from fastapi.responses import Response

from vlserve.core.config import PREFILL, Options
from vlserve.core.cpu_budget import size_default_executor
from vlserve.core.errors import InvalidInputError, ServiceUnavailableError
from vlserve.core.lora import AdapterRef, PeerAdapter
from vlserve.core.processes import SigtermStop, finish
from vlserve.disagg.auth import PeerAuth, require_secret
from vlserve.disagg.messages import (
    TransferRequest,
    Pong,
    TransferState,
)
from vlserve.disagg.metrics import ScrapeTimeGauges, TransferMetrics
from vlserve.disagg.peer_kinds import PREFILL_PEERS
from vlserve.disagg.remote_encoder import remote_prompt_encoder
from vlserve.disagg.sender import OutgoingTransfer, SenderService
from vlserve.disagg.transports.base import HeadersOnly
from vlserve.core.wire import KVSend
from vlserve.disagg.row_map import RowMap
from vlserve.disagg.transports.row_writer import encode_destination, row_writer_maker, send_deadline
from vlserve.disagg.registry import advertised_host
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.frontend.kv_writes import KVWriteUnsettled
from vlserve.frontend.metrics import CONTENT_TYPE
from vlserve.lora.catalog import with_adapter

logger = logging.getLogger("vlserve.prefill")


class PrefillService(SenderService):
    def __init__(self, engine: AsyncLLM, opts: Options):
        self.engine, d, host = engine, opts.disagg, opts.server.host
        auth = PeerAuth(d.disagg_secret)
        require_secret(auth, "this prefill instance")
        # The engine process writes the KV rows with its own transport (run_prefill gives it a row writer): this
        # process sends headers only.
        public = advertised_host(d, host)
        self._setup(host, d.data_port or opts.server.port + 1, auth, HeadersOnly(d.transfer_backend, public),
                    TransferMetrics(engine.metrics.registry, None, PREFILL, "kv"), d.transfer_timeout,
                    d.transfer_failure_prob)
        engine.metrics.registry.register(ScrapeTimeGauges(lambda: [
            ("prefill_requests_in_flight", self.in_flight, "Prefills being computed for decode instances."),
            ("prefill_transfers_held", len(self.sender.transfers) if self.sender else 0,
             "KV transfers whose chunk is being sent to a decode instance."),
            ("prefill_kv_rows_kept", engine.metrics.stats.kv_rows_kept,
             "Prefills whose KV rows the engine keeps to write into decode instances itself.")]))
        self.working: dict[tuple, asyncio.Task] = {}  # transfers being prefilled: an abort cancels them
        self._ids = itertools.count()
        self.address = f"{advertised_host(d, host)}:{self.data_port}"  # how refusals name this instance

    @property
    def in_flight(self) -> int:
        return len(self.working)

    def pong(self, nonce: int) -> Pong:
        m = self.engine.cfg.model
        return Pong(nonce, self.in_flight, m.architecture, m.text.hidden_size, m.side_rows,
                    m.kv_row_width, PREFILL_PEERS.tail_rows(self.engine.cfg))

    def on_request(self, peer: bytes, msg: TransferRequest) -> None:
        key = (peer, msg.request_id, msg.transfer_id)
        task = self.working[key] = self.spawn(self._prefill(key, msg, time.time()))
        # Popped when done, even if an abort cancels it before it ever ran.
        task.add_done_callback(lambda _: self.working.pop(key, None))

    def on_abort(self, key) -> None:
        task = self.working.get(key)
        if task is not None and key not in self.sender.transfers:
            task.cancel()  # still prefilling: the engine drops the request (a send under way is let finish)

    async def _blocks(self, key, req: TransferRequest, prompt, arrived: float) -> tuple[list[int], float]:
        """The receiver's blocks for every row of the prompt, and from when (time.time()) its writes may start
        for the time it gives (`write_within_s`): its first run came with the request (`arrived`); what more the
        prompt needs the receiver appends when asked (`RowsWanted`), so the rows fill them in one chunk, and the
        time counts from its answer (the receiver keeps every block that long after it answered: a wait for its
        blocks does not eat the prompt's writing time)."""
        total, tail = prompt.num_tokens, PREFILL_PEERS.tail_rows(self.engine.cfg)
        rows = RowMap(prompt.mm_items, True, tail).rows_through(total, total)
        blocks = list(req.block_ids)
        if not blocks:
            raise ServiceUnavailableError(f"the decode instance offered no room for the first of {total} tokens")
        have = len(blocks) * req.block_tokens
        if rows > have:
            blocks += await self.sender.ask_rows(key, rows - have)
            arrived = time.time()
            if len(blocks) * req.block_tokens < rows:
                raise ServiceUnavailableError(f"the decode instance gave {len(blocks)} blocks of "
                                              f"{req.block_tokens} rows for a prompt of {rows} rows")
        return blocks, arrived

    def _send_of(self, key, engine_id: str, req: TransferRequest, prompt, blocks: list[int],
                 since: float) -> tuple[KVSend, asyncio.Future]:
        """Where the engine writes the prompt's rows as it computes them, and the future of that send's end. An
        abort is acknowledged only once the engine says no write of it runs (`TransferSender.settling`); an engine
        that stopped answering leaves it unacknowledged (the receiver's quarantine frees those blocks). Every check
        comes first: a request refused here leaves nothing behind."""
        destination = encode_destination(req.target, blocks, self.transport.name)
        not_after = send_deadline(since, req.write_within_s, self.timeout)
        write_id, sent = self.engine.kv_writes.expect(engine_id)
        settled = self.sender.settling[key] = asyncio.get_running_loop().create_future()

        def on_sent(future: asyncio.Future) -> None:
            if not future.cancelled() and isinstance(future.exception(), KVWriteUnsettled):
                self.sender.unsettle(key)  # the receiver must not hear its blocks are free
            if self.sender.settling.get(key) is settled:
                del self.sender.settling[key]
            settled.set_result(None)

        sent.add_done_callback(on_sent)
        return KVSend(write_id, prompt.num_tokens, destination, not_after), sent

    async def _prefill(self, key, req: TransferRequest, arrived: float) -> None:
        self.metrics.state(TransferState.WAITING_FOR_INPUT)
        try:
            if req.params is None:
                raise InvalidInputError("this is a prefill instance: a request needs its sampling parameters")
            adapter = None if req.lora is None else self._adapter(req.lora)
            prompt = self.start_request(req)
            engine_id = f"p{next(self._ids)}-{req.request_id[:128]}"
            with await self.engine.prepare(prompt, req.mm_processor_kwargs, request_id=engine_id,
                                           adapter=adapter) as prepared:
                computed = with_adapter(prepared.prompt, adapter)  # the item hashes the decode side keys by
                blocks, since = await self._blocks(key, req, computed, arrived)
                kv_send, sent = self._send_of(key, engine_id, req, computed, blocks, since)
                handoff = await self.engine.prefill(prepared, req.params, engine_id, adapter,  # takes it over
                                                    kv_send=kv_send)
            transfer = OutgoingTransfer(key, computed, req.block_tokens, every_token=True,
                                        tail_rows=PREFILL_PEERS.tail_rows(self.engine.cfg), target=req.target,
                                        handoff=handoff)
            # The engine writes every row as it computes the prompt (`kv_send`); the chunk's header goes once that
            # send has ended. What it keeps of the request goes when the transfer ends.
            transfer.on_end = functools.partial(self.engine.kv_writes.release, engine_id)
            transfer.write_rows = lambda start, end, block_ids: asyncio.shield(sent)
            if self.sender.hold(transfer):
                await self.sender.send_chunk(transfer, 0, blocks)
            else:
                transfer.on_end()  # aborted while it was prefilled
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the receiver, which frees its blocks
            await self.request_failed(key, e)

    def _adapter(self, named: PeerAdapter) -> AdapterRef:
        """The adapter of this instance's own catalogue (--lora-modules) the request names, or a 503 (its limit,
        not the request's fault: the decode instance tries another prefill instance). No file is read."""
        loras = self.engine.loras
        ref = None if loras is None else loras.resolve(named)
        if ref is not None:
            return ref
        why = ("it serves no LoRA adapters (start it with --enable-lora)" if loras is None else
               "it serves no adapter of that name with those weights (start it with --lora-modules NAME=PATH, the "
               "same files as the decode instance's)")
        logger.warning("LoRA adapter %r refused: %s", named.name[:256], why)
        raise ServiceUnavailableError(f"prefill instance {self.address} cannot apply LoRA adapter "
                                      f"{named.name[:256]!r}: {why}")

    def http_app(self) -> FastAPI:
        app = FastAPI(title="vlserve prefill", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health():
            if not self.engine.is_healthy:
                return Response(f"the engine is not available: {self.engine.unhealthy_reason}", status_code=503)
            return Response(status_code=200)

        @app.get("/ready")
        async def ready():
            reason = self.engine.not_ready_reason
            return Response(f"not ready: {reason}" if reason else None, status_code=503 if reason else 200)

        @app.get("/metrics")
        async def metrics():
            return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

        return app


async def run_prefill(opts: Options, log_level: str) -> int:
    """The prefill role: bind the data socket, start the engine (which registers with the bootstrap through its
    peer client, under role "prefill" with the data address), serve until stopped. Returns the exit code: 1
    when the engine died (a supervisor restarts the instance)."""
    host, port = opts.server.host, opts.server.port
    data_port = opts.disagg.data_port or port + 1
    size_default_executor(opts.engine.cpu_threads)
    with SigtermStop() as sigterm:
        public = advertised_host(opts.disagg, host)
        encoder = remote_prompt_encoder(opts.disagg, f"{public}:{port}", opts.engine.model, PREFILL,
                                        data_address=f"{public}:{data_port}")
        writer = row_writer_maker(opts.disagg.transfer_backend, public, opts.disagg.transfer_timeout,
                                  opts.disagg.disagg_secret, opts.disagg.kv_send_by_layer)
        engine = AsyncLLM(opts.engine, opts.engine.model, media_threads=opts.server.media_threads,
                          log_requests=False, log_level=log_level,
                          heartbeat_timeout=opts.server.engine_heartbeat_timeout, prompt_encoder=encoder,
                          kv_role=PREFILL, kv_writer=writer)
        service = PrefillService(engine, opts)
        try:
            service.bind()
            await engine.start()
            logger.info("prefill instance ready: data tcp://%s:%d, http://%s:%d", host, data_port, host, port)
            sigterm.serving()
            try:
                await service.run(service.http_app(), port, log_level, stop=engine.dead)
            finally:
                await finish(engine.shutdown())
        finally:
            service.transport.close()
            service.auth.stop()
        if engine.core.dead_reason is not None:
            logger.error("the engine is gone (%s): exiting with code 1", engine.core.dead_reason)
            return 1
        return 0
    return 0  # stopped by SIGTERM during start-up
