"""The prompt encoder of a server whose prompts are worked on elsewhere, the output landing in this server's
receive blocks where the engine reads it:
- a language server (or prefill instance): prompts with media go to an encoder service (embedding rows);
  prompts without media stay local;
- a decode instance: every prompt with text goes to a prefill instance (KV rows and the first token); only
  token-id prompts are prefilled here.

What this server's options forbid is refused here with the aggregated server's status (too many items,
embeddings input off), before any peer is asked; everything else is the peer's to check (an encoder under its
own media policy), and its verdict comes back with the same status.
"""

from __future__ import annotations

from vlserve.core.config import DECODE, DisaggArgs, kv_cache_shared
from vlserve.core.errors import ConfigurationError, InvalidInputError
from vlserve.core.lora import AdapterRef
from vlserve.disagg.auth import PeerAuth, require_secret
from vlserve.disagg.registry import InstanceInfo, new_instance_id
from vlserve.disagg.peer_client import PeerClient
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PREFILL_PEERS, PeerKind
from vlserve.disagg.metrics import ScrapeTimeGauges, TransferMetrics
from vlserve.disagg.receive_pool import EngineKVBlocks
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.transports.row_writer import decode_target
from vlserve.engine.transfer_buffers import TransferBuffers, unlink_name
from vlserve.frontend.prompt_encoder import EncodedPrompt, LocalPromptEncoder


def _has_urls(media: dict) -> bool:
    return any(isinstance(src, str) for items in media.values() for src in items)


class RemotePromptEncoder:
    def __init__(self, engine, opts: DisaggArgs, info: InstanceInfo, kind: PeerKind = ENCODER_PEERS,
                 model: str = ""):
        """`info`: how this server registers (its role and the address peers reach it by); `model`: the model as
        the roles name it (the registry's default namespace)."""
        self.cfg, self.kind, self.engine, self.opts, self.info, self.model = engine.cfg, kind, engine, opts, info, model
        self.local = LocalPromptEncoder(engine.input_processor, {}, engine.executor)  # text and embeddings
        # A decode engine on the CPU keeps its KV cache in shared files (one a rank): peers write into them, no
        # receive blocks.
        self.kv_in_place = kind.rows_for_every_token and kv_cache_shared(
            DECODE, engine.args.tensor_parallel_size, engine.facts.torch_device.type)
        self.transfer_buffers: TransferBuffers | None = None  # receive blocks the engine reads rows from
        if not self.kv_in_place:
            width = self.cfg.model.kv_row_width if kind.rows_for_every_token else self.cfg.model.embedding_width
            self.transfer_buffers = TransferBuffers.create(kind.buffer_blocks(opts), opts.receive_block_rows, width,
                                                           self.cfg.dtype)
        payload = "kv" if kind.rows_for_every_token else "embedding"  # (metric names kept as they were)
        # A decode engine gives out the blocks peers write (of its KV cache, or receive blocks): its gauge counts them
        local = None if kind.rows_for_every_token else self.transfer_buffers
        self.metrics = TransferMetrics(engine.metrics.registry, local, info.role, payload)
        self.client: PeerClient | None = None  # a decode instance's once its engine registered where KV lands
        if not kind.rows_for_every_token:
            self.client = PeerClient(self.cfg, self.transfer_buffers, self.metrics, opts, info, kind, model=model)
        engine.metrics.registry.register(_PeerGauge(self))
        if kind.rows_for_every_token:
            engine.metrics.registry.register(ScrapeTimeGauges(lambda: [(
                "decode_kv_blocks_reserved", engine.metrics.stats.kv_blocks_reserved,
                "Blocks the engine holds for prefill instances' writes: of its KV cache until a request takes them, "
                "or receive blocks (a GPU, torchrun's ranks) until they are copied in.")]))
        self.started = False

    async def start(self) -> None:
        if self.kind.rows_for_every_token:
            # A decode engine has registered where prompts' KV lands with its own transport (its KV cache in
            # shared files; or, on a GPU, the receive blocks), and reserves the blocks for each transfer:
            # peers write there, this process only checks headers.
            if self.engine.kv_target is None or (self.kv_in_place and self.engine.kv_layout is None):
                raise ConfigurationError("the decode engine did not register where prompts' KV lands")
            if self.kv_in_place:  # known by its layout only: no KV byte is read here (the engine checks them)
                buffers = self.engine.kv_layout
                rows = self.engine.num_kv_blocks * buffers.block_tokens
            else:
                buffers = self.transfer_buffers
                rows = buffers.num_blocks * buffers.block_tokens
            pool = EngineKVBlocks(self.engine.kv_reservations, rows)
            self.client = PeerClient(self.cfg, buffers, self.metrics, self.opts, self.info, self.kind,
                                     model=self.model, pool=pool, target=decode_target(self.engine.kv_target))
        # The engine process has mapped the buffers by now: the name can go (no file outlives a crash), unless
        # encoders or prefill instances on this host map it by name (shm); then a crashed server's file is swept by
        # the next start.
        if not TRANSPORTS[self.opts.transfer_backend].maps_receiver_file:
            if self.kv_in_place:
                if self.engine.kv_layout.path:  # ("": the engine's KV cache is in no file this process could name)
                    unlink_name(self.engine.kv_layout.path)
            else:
                self.transfer_buffers.unlink()
        await self.client.start()
        self.started = True

    def not_ready_reason(self) -> str | None:
        if not self.started:
            return "starting"
        if self.client is None or not self.client.num_available:
            return f"no {self.kind.name} is paired yet"
        return None

    async def stop(self) -> None:
        """Also right after a failed start-up (the engine never came up): then only the file goes."""
        if self.transfer_buffers is not None:
            self.transfer_buffers.unlink()
        if self.started:
            await self.client.stop()
        elif self.client is not None:
            self.client.transport.close()  # its row socket, listening since it was made

    async def encode(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str,
                     params=None, lora: AdapterRef | None = None, peer: str | None = None) -> EncodedPrompt:
        media = prompt.get("multi_modal_data") or {}
        prefill = self.kind.rows_for_every_token
        if not (_has_urls(media) or (prefill and "prompt" in prompt)):
            return await self.local.encode(prompt, mm_processor_kwargs, request_id)
        if prefill and params is None:
            raise InvalidInputError("a decode instance needs the request's sampling parameters to have it prefilled")
        if prefill and params.n != 1:  # before any prefill work
            raise InvalidInputError("n > 1 is not supported by a decode instance (its prompt is prefilled once, "
                                    "elsewhere); send n requests")
        for kind, items in media.items():
            limit = self.cfg.limit_mm_per_prompt.get(kind, 0)
            if len(items) > limit:
                raise InvalidInputError(f"{len(items)} {kind}s in one prompt; at most {limit} allowed "
                                        f"(--limit-mm-per-prompt {kind}={limit})")
            if not self.cfg.enable_mm_embeds and any(isinstance(src, dict) for src in items):
                raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        if "prompt" not in prompt:
            raise InvalidInputError("a prompt with media needs its text (token ids cannot carry placeholders here)")
        # A prefill instance runs the whole prompt with the adapter (its encoders the towers' part); an encoder
        # only needs an adapter of the towers.
        sent = lora if lora is not None and (prefill or lora.towers) else None
        processed, handoff = await self.client.send_prompt(request_id or "prompt", prompt["prompt"], media,
                                                      prompt.get("multi_modal_uuids") or {}, mm_processor_kwargs or {},
                                                      params if prefill else None, sent, prefer=peer)
        if sent is not None:
            processed.lora = lora  # the peer gave its items the adapter's own hashes: not salted again here
        # Called once, by the prompt's owner (frontend.prepared_prompt): the engine is done with the rows, or
        # never got them.
        return EncodedPrompt(processed, self.client.take_release(processed), handoff)


def remote_prompt_encoder(opts: DisaggArgs, http_address: str, model: str, role: str = "language",
                          data_address: str = "", kv_events: str = ""):
    """A language server's (role "language"), a prefill instance's ("prefill": it registers its data address,
    where decode instances reach it) or a decode instance's ("decode": its peers are prefill instances)."""
    names = {"language": "this language server", "decode": "this decode instance"}
    require_secret(PeerAuth(opts.disagg_secret), names.get(role, f"this {role} instance"))  # before anything loads

    def build(engine) -> RemotePromptEncoder:
        info = InstanceInfo(new_instance_id(), role, data_address or http_address, http_address, kv_events=kv_events)
        return RemotePromptEncoder(engine, opts, info, PREFILL_PEERS if role == "decode" else ENCODER_PEERS, model)
    return build


class _PeerGauge:
    def __init__(self, encoder: RemotePromptEncoder):
        self.encoder = encoder

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        kind, client = self.encoder.kind, self.encoder.client
        name = {"encode": "encoders_available", "prefill": "prefill_instances_available"}[kind.role]
        g = GaugeMetricFamily(f"vlserve:{name}", f"{kind.name.capitalize()}s this server can send work to.")
        g.add_metric([], float(client.num_available if client is not None else 0))
        yield g
