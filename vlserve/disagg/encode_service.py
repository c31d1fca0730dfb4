"""`vlserve encode`: a vision-encoder service built from the engine's own parts.

A language server sends a prompt with media and the ids of its receive blocks. The service:
- fetches the media under its own URL policy and turns the prompt into a `ProcessedPrompt` with the same
  `LocalPromptEncoder` an aggregated server uses (decoding, preprocessing, tokenizing, placeholder expansion,
  positions, every size limit);
- runs its media towers with the engine's `EncoderRunner`, deciding what to run and what to keep with the
  engine's `EncoderCacheManager` (keyed by mm_hash): a picture seen before is not encoded again. The tower is
  loaded like the engine's model (`start_executor`: a `ModelShard`, or a tensor-parallel leader whose ranks
  split its weights, or with `--mm-encoder-tp-mode data` each encode a share of the pictures);
- sends, chunk by chunk, each token's fill id and positions, and writes each media token's embedding row into
  the receiver's blocks (item after item) through the transport. Text tokens never take a row. When the
  receiver's blocks run out it asks to resume; meanwhile the rows wait in the encoder cache, held for that
  transfer (no staging copy).

A request may name a LoRA adapter of the towers (`--enable-lora`), by name and content key, never by path: the
encoder applies the adapter of that name it serves (`--lora-modules`) if its key is the same. Its items get hashes
of their own (the cache never mixes adapters) and the towers run with the adapter in a slot; its weights are read
on a loader thread, never the vision thread. An encoder that cannot apply it (started without --enable-lora, no
such adapter or other files under that name, its files unreadable now) refuses with a 503 naming itself and why:
the language server tries another encoder.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from vlserve.core.config import TOWER_MODALITIES, Options
from vlserve.core.cpu_budget import media_pool_size, plan_threads, size_default_executor
from vlserve.core.errors import ConfigurationError, InvalidInputError, ServiceUnavailableError
from vlserve.core.lora import AdapterRef, PeerAdapter
from vlserve.core.processes import SigtermStop, finish
from vlserve.core.prompt import MEDIA_KINDS, ProcessedPrompt, media_kinds_needed
from vlserve.disagg.auth import PeerAuth, require_secret
from vlserve.disagg.messages import (
    Pong,
    TransferRequest,
    TransferState,
)
from vlserve.disagg.metrics import ScrapeTimeGauges, TransferMetrics
from vlserve.disagg.sender import OutgoingTransfer, SenderService, media_rows
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.registry import advertised_host
from vlserve.engine.config import resolve_config
from vlserve.engine.cpu_threads import apply_cpu_threads
from vlserve.engine.encoder_cache import EncoderCacheManager
from vlserve.engine.encoder_runner import EncoderRunner
from vlserve.engine.executor import encodes_whole_step, start_executor
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.input_processor import InputProcessor
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import CONTENT_TYPE, LATENCY_BUCKETS, PREFIX
from vlserve.frontend.prompt_encoder import LocalPromptEncoder
from vlserve.lora.catalog import LoRACatalog, parse_lora_modules, with_adapter
from vlserve.model.facts import resolve_model_facts
from vlserve.model.hardware import log_once

logger = logging.getLogger("vlserve.encode")


class EncodeService(SenderService):
    def __init__(self, opts: Options):
        server, d = opts.server, opts.disagg
        engine = dataclasses.replace(opts.engine, load_language=False)  # the media towers only, no KV cache
        self.opts, self.d = opts, d
        auth = PeerAuth(d.disagg_secret)
        require_secret(auth, "this encoder")  # refused before anything loads
        facts = resolve_model_facts(engine, media=server.media_bounds())
        try:
            self.cfg = resolve_config(engine, facts)
        except InvalidInputError as e:  # e.g. a --tensor-parallel-size that cannot split this tower
            raise ConfigurationError(f"this encoder cannot start with these options: {e}") from None
        log_once()
        threads = plan_threads(engine.cpu_threads, self.cfg.tensor_parallel_size)
        media_pool = media_pool_size(server.media_threads, threads.total)
        apply_cpu_threads(media_pool=media_pool, plan=threads)  # before the towers load: their packing uses them
        processor = InputProcessor.for_model(FrontendConfig.of(facts, engine), **server.media_bounds())
        self.executor = ThreadPoolExecutor(max_workers=media_pool, thread_name_prefix="vlserve-media")
        fetchers = {kind: MediaFetcher(MediaPolicy.from_args(server, kind)) for kind in MEDIA_KINDS}
        self.prompts = LocalPromptEncoder(processor, fetchers, self.executor)
        transport = TRANSPORTS[d.transfer_backend](advertised_host(d, server.host), d.disagg_secret)
        # Loaded like the engine's model: one device, or tensor-parallel ranks (stopped with this service).
        self.tower = start_executor(self.cfg)
        self.encoders = EncoderRunner(self.tower, self.cfg.device, encodes_whole_step(self.tower))
        self.cache = EncoderCacheManager.for_model(self.cfg.encoder_cache_size, self.cfg.model)
        self.vit = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-vit")  # one vision call at a time
        self.encoding: dict[str, asyncio.Future] = {}  # mm_hash -> its vision call, while it runs
        self.width = self.cfg.model.embedding_width
        self.registry = CollectorRegistry()
        self._setup(server.host, d.data_port if d.data_port is not None else server.port + 1, auth, transport,
                    TransferMetrics(self.registry, None, "encode"), d.transfer_timeout, d.transfer_failure_prob)
        self.address = f"{advertised_host(d, server.host)}:{self.data_port}"  # how refusals name this encoder
        self.lora = getattr(self.tower, "lora", None)  # tower adapter slots (--enable-lora); the vision thread's
        # adapter key -> requests using it now: host memory keeps those adapters
        self.adapters_in_flight: collections.Counter[str] = collections.Counter()
        self.catalog: LoRACatalog | None = None  # the adapters it applies (--lora-modules), checked at start
        if self.lora is not None:
            self.lora.in_use = lambda: set(self.adapters_in_flight)
            self.catalog = LoRACatalog(self.cfg.model, self.cfg.model_path, engine.max_lora_rank,
                                       self.cfg.lora.max_cpu_bytes, self.cfg.dtype)
            for name, path in parse_lora_modules(engine.lora_modules):  # a bad one stops the start with its reason
                self.catalog.load(name, path)
        self.lora_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-lora")
        self._reading: dict[str, asyncio.Future] = {}  # adapter key -> its read under way
        self.registry.register(_EncoderStats(self))
        self.encoder_latency = Histogram(PREFIX + "encoder_latency_seconds", "Media encoder time per tower call, "
                                         "by tower (vision, audio).", ["tower"], registry=self.registry,
                                         buckets=LATENCY_BUCKETS)
        self.in_flight = 0
        # What its loaded towers encode (--towers): all it announces, and all it takes.
        self.modalities = tuple(k for t in self.cfg.towers for k in TOWER_MODALITIES[t])
        self.mm_items = Counter(PREFIX + "mm_items", "Media items in prompts taken for encoding, by modality.",
                                ["modality"], registry=self.registry)
        for kind in self.modalities:
            self.mm_items.labels(kind)
        for tower in self.cfg.towers:
            self.encoder_latency.labels(tower)

    def pong(self, nonce: int) -> Pong:
        m = self.cfg.model
        return Pong(nonce, self.in_flight, m.architecture, m.text.hidden_size, m.side_rows,
                    modalities=list(self.modalities))

    def check_kinds(self, media: dict, mm_processor_kwargs: dict | None) -> None:
        """Refuses media this encoder has no tower for. A 503 (not the request's fault): the receiver tries an
        encoder that announced those kinds, if any (it should only ever have sent it to one)."""
        missing = media_kinds_needed(media, mm_processor_kwargs, self.cfg.model.modalities) - set(self.modalities)
        if missing:
            raise ServiceUnavailableError(
                f"this encoder has no tower for {' and '.join(sorted(missing))} items (its --towers: "
                f"{' '.join(self.cfg.towers) or 'none'}, encoding {', '.join(self.modalities) or 'nothing'})")

    def on_request(self, peer: bytes, msg: TransferRequest) -> None:
        self.spawn(self._encode(peer, msg))

    # ---- one transfer --------------------------------------------------------------------------------------
    async def _encode(self, peer: bytes, req: TransferRequest) -> None:
        key = (peer, req.request_id, req.transfer_id)
        self.in_flight += 1
        self.metrics.state(TransferState.WAITING_FOR_INPUT)
        adapter = None
        try:
            if req.params is not None:
                raise InvalidInputError("this is an encoder, not a prefill instance: check the roles' registry")
            self.check_kinds(req.media, req.mm_processor_kwargs)
            if req.lora is not None:
                adapter = self._adapter(req.lora)
                self.adapters_in_flight[adapter.key] += 1
                await self._take_adapter(adapter)
            prompt = self.start_request(req)
            processed = (await self.prompts.encode(prompt, req.mm_processor_kwargs, req.request_id)).prompt
            processed = with_adapter(processed, adapter)  # its items' hashes: this adapter's own
            for item in processed.mm_items:
                self.mm_items.labels(item.modality).inc()
            holder = f"{req.request_id}/{req.transfer_id}/{peer.hex()}"
            transfer = OutgoingTransfer(key, processed, req.block_tokens, target=req.target,
                                        on_end=lambda: self.encoders.free(self.cache.release_all(holder,
                                                                                               processed.mm_items)))
            if not self.sender.hold(transfer):
                return
            item_rows = await self._embeddings(processed, holder)
            transfer.rows_of = media_rows(processed, item_rows, self.width)
            await self.sender.send_chunk(transfer, 0, req.block_ids)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the receiver, which frees its blocks
            await self.request_failed(key, e)
        finally:
            self.in_flight -= 1
            if adapter is not None:
                self.adapters_in_flight[adapter.key] -= 1
                if not self.adapters_in_flight[adapter.key]:
                    del self.adapters_in_flight[adapter.key]

    async def warm(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str) -> int:
        """Encodes a prompt's media into the encoder cache now, for the language server that asks for them next
        (Dynamo's encode step, vlserve.dynamo.encode_worker): they stay there as any cached item, unheld. Returns
        how many items the prompt has."""
        self.check_kinds(prompt.get("multi_modal_data") or {}, mm_processor_kwargs)
        self.in_flight += 1
        try:
            # (its items are counted in `mm_items` by the transfer that follows, not here)
            processed = (await self.prompts.encode(prompt, mm_processor_kwargs, request_id)).prompt
            holder = f"warm/{request_id}/{secrets.token_hex(4)}"
            try:
                await self._embeddings(processed, holder)
            finally:
                self.encoders.free(self.cache.release_all(holder, processed.mm_items))
            return len(processed.mm_items)
        finally:
            self.in_flight -= 1

    def _adapter(self, named: PeerAdapter) -> AdapterRef:
        """The adapter of this encoder's own catalogue (--lora-modules) a request names, or a 503: what keeps it
        from applying one is its own limit, not the request's fault, so the language server tries another
        encoder. No file is read."""
        ref = None if self.catalog is None else self.catalog.resolve(named)
        if ref is None:
            self._refuse(named.name, "it serves no LoRA adapters (start it with --enable-lora)" if self.catalog is None
                         else "it serves no adapter of that name with those weights (start it with --lora-modules "
                         "NAME=PATH, the same files as the language server's)")
        return ref

    async def _take_adapter(self, ref: AdapterRef) -> None:
        """The adapter's weights into host memory, read on the loader thread (one read per adapter however many
        requests wait for it), then handed to the vision thread, which alone uses the slots."""
        if self.lora.holds(ref):
            return
        reading = self._reading.get(ref.key)
        if reading is None:
            reading = self._reading[ref.key] = asyncio.ensure_future(self._read(ref))
            reading.add_done_callback(lambda done: (self._reading.pop(ref.key, None),  # its error: retrieved
                                                    done.cancelled() or done.exception()))
        try:
            await asyncio.shield(reading)
        except (InvalidInputError, OSError) as e:  # the detail names this encoder's files: its log only
            logger.warning("LoRA adapter %r could not be read from %s: %s", ref.name[:256], ref.path, e)
            self._refuse(ref.name, "its files could not be read as they were at its start (its log says why)")

    async def _read(self, ref: AdapterRef) -> None:
        loop = asyncio.get_running_loop()
        weights = await loop.run_in_executor(self.lora_reader, self.lora.read, ref)
        await loop.run_in_executor(self.vit, self.lora.insert, ref, weights)

    def _refuse(self, name: str, why: str) -> None:
        logger.warning("LoRA adapter %r refused: %s", name[:256], why)
        raise ServiceUnavailableError(f"encoder {self.address} cannot apply LoRA adapter {name[:256]!r}: {why}")

    async def _embeddings(self, prompt: ProcessedPrompt, holder: str) -> list[torch.Tensor]:
        """Each media item's rows: from the encoder cache, a vision call in flight, or a new one (batched).
        They stay held for `holder` until its transfer ends."""
        items = prompt.mm_items
        todo, waits = [], []
        try:
            for i, item in enumerate(items):
                if not item.needs_encoder:
                    continue
                if self.cache.holds((holder, i), item) or self.cache.lookup((holder, i), item):
                    if item.mm_hash in self.encoding:
                        waits.append(self.encoding[item.mm_hash])
                    continue
                if not self.cache.can_allocate(item.num_tokens):
                    raise ServiceUnavailableError("the encoder cache is full of pictures still being sent; retry "
                                                  "later")
                self.encoders.free(self.cache.allocate((holder, i), item))
                if item.mm_hash in self.encoding:
                    # Its entry was evicted while its vision call runs (the request that started it left): that
                    # call's output lands in the entry just allocated; wait for it rather than encode it twice.
                    waits.append(self.encoding[item.mm_hash])
                else:
                    self.encoding[item.mm_hash] = asyncio.get_running_loop().create_future()
                    todo.append(item)
        except BaseException as e:
            self._encoded(todo, e)  # what this request set out to encode never will be
            raise
        if todo:
            # Settled when the tower is done, even if this request is cancelled meanwhile (others may wait on it).
            call = asyncio.get_running_loop().run_in_executor(self.vit, self._run_tower, todo, prompt.lora)
            call.add_done_callback(
                lambda done: self._encoded(todo, asyncio.CancelledError() if done.cancelled() else done.exception()))
            await asyncio.shield(call)
        for wait in waits:
            await asyncio.shield(wait)
        return [self.encoders.outputs[it.mm_hash] if it.needs_encoder else it.embeddings for it in items]

    def _run_tower(self, items: list, lora: AdapterRef | None = None) -> None:
        """On the vision thread: the tower over `items` (with adapter `lora`), each call's time into the latency
        histogram."""
        try:
            if lora is None:
                self.encoders.encode(items)
            else:
                slot = self.lora.assign([lora])[lora.key]
                self.encoders.encode(items, [slot] * len(items))
        finally:
            for tower, seconds in self.encoders.take_seconds():
                self.encoder_latency.labels(tower).observe(seconds)

    def _encoded(self, items: list, error: BaseException | None) -> None:
        """The tower is done with `items` (or will never run them): requests waiting for them go on, or fail with
        `error`. A failed encoding leaves no trace: its cache entries go (a later request for the same picture
        encodes it again instead of finding an entry with no output) and so do any outputs it stored."""
        if error is not None:
            hashes = [it.mm_hash for it in items]
            self.encoders.free(hashes)
            for mm_hash in hashes:
                self.cache.discard(mm_hash)
        else:
            # An entry evicted while its call ran (nobody held it, nobody asked again) had its output freed before
            # the output existed: drop what the call stored since, or it stays outside the cache's accounting.
            self.encoders.free([it.mm_hash for it in items if it.mm_hash not in self.cache])
        for item in items:
            future = self.encoding.pop(item.mm_hash, None)
            if future is None or future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(ServiceUnavailableError(f"the vision encoder failed: {error}"))
                future.exception()  # retrieved: a failure nobody else waited for is not "never retrieved"

    # ---- HTTP side ---------------------------------------------------------------------------------------
    def http_app(self) -> FastAPI:
        app = FastAPI(title="vlserve encode", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health():  # a lost tensor-parallel rank ends the tower for good (every call fails after it)
            failure = getattr(self.tower, "failure", None)
            return Response(failure, status_code=503) if failure else Response(status_code=200)

        @app.get("/ready")
        async def ready():  # it serves as soon as it answers: its model is loaded and its data socket bound
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

        return app

    async def aclose(self) -> None:
        await self.prompts.stop()
        self.auth.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.lora_reader.shutdown(wait=False, cancel_futures=True)
        # a vision call in flight finishes first: the tensor-parallel ranks are stopped between calls
        await asyncio.to_thread(self.vit.shutdown, wait=True, cancel_futures=True)
        self.tower.shutdown()


class _EncoderStats:
    """Encoder-cache counters and load of an encode service, read at scrape time (the vision-call latency is a
    histogram of its own, observed as calls end)."""

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
        yield from ScrapeTimeGauges(lambda: [
            ("encode_requests_in_flight", s.in_flight, "Encode requests being worked on."),
            ("encode_transfers_held", len(s.sender.transfers) if s.sender else 0,
             "Transfers whose items the encoder cache holds (being sent or waiting for a resume)."),
            ("encoder_cache_used_tokens", s.cache.used,
             "Embedding rows in the encoder cache (1 + DeepStack levels per media token).")]).collect()


async def run_encoder(opts: Options, log_level: str) -> int:
    """The encode role: bind the data socket, register with the bootstrap, serve until stopped."""

    from vlserve.disagg.registries import open_registry
    from vlserve.disagg.registry import InstanceInfo, advertised_host, new_instance_id

    size_default_executor(opts.engine.cpu_threads)
    # (the model loads synchronously: a SIGTERM then takes effect at the first await)
    with SigtermStop() as sigterm:
        service = EncodeService(opts)
        try:
            service.bind()
            host, port = advertised_host(opts.disagg, opts.server.host), opts.server.port
            info = InstanceInfo(new_instance_id(), "encode", f"{host}:{service.data_port}", f"{host}:{port}")
            boot = open_registry(opts.disagg, info, opts.engine.model, load_fn=lambda: service.in_flight,
                                 auth=service.auth)
            await boot.start()
            try:
                logger.info("encoder ready: data tcp://%s, http://%s", info.address, info.http_address)
                sigterm.serving()
                await service.run(service.http_app(), port, log_level)
            finally:
                await finish(boot.stop())
        finally:
            await finish(service.aclose())
    return 0
