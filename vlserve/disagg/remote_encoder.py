"""The language server's prompt encoder: prompts with media go to an encoder service, whose output lands in this
server's receive blocks, where the engine reads it in place; prompts without media stay local.

What this server's options forbid is refused here with the aggregated server's status (too many items,
embeddings input off), before any encoder is asked; everything else is the encoder's to check under its own
media policy, and its verdict comes back with the same status.
"""

from __future__ import annotations

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError
from vlserve.disagg.bootstrap import InstanceInfo, new_instance_id
from vlserve.disagg.encoder_client import EncoderClient
from vlserve.disagg.metrics import TransferMetrics
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.prompt_encoder import EncodedPrompt, LocalPromptEncoder


def _has_urls(media: dict) -> bool:
    return any(isinstance(src, str) for items in media.values() for src in items)


class RemotePromptEncoder:
    def __init__(self, engine, opts: DisaggArgs, http_address: str):
        self.cfg = engine.cfg
        self.local = LocalPromptEncoder(engine.input_processor, {}, engine.executor)  # text and embeddings
        self.transfer_buffers = TransferBuffers.create(opts.embedding_buffer_blocks, opts.embedding_block_tokens,
                                                       self.cfg.model.embedding_width, self.cfg.dtype)
        metrics = TransferMetrics(engine.metrics.registry, self.transfer_buffers, "language")
        info = InstanceInfo(new_instance_id(), "language", http_address, http_address)
        self.client = EncoderClient(self.cfg, self.transfer_buffers, metrics, opts, info)
        engine.metrics.registry.register(_EncoderGauge(self.client))
        self.started = False

    async def start(self) -> None:
        # The engine process has mapped the buffers by now: the name can go (no file outlives a crash), unless
        # encoders on this host map it by name (shm); then a crashed server's file is swept by the next start.
        if not self.client.transport.maps_receiver_file:
            self.transfer_buffers.unlink()
        await self.client.start()
        self.started = True

    async def stop(self) -> None:
        """Also right after a failed start-up (the engine never came up): then only the file goes."""
        self.transfer_buffers.unlink()
        if self.started:
            await self.client.stop()

    async def encode(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str) -> EncodedPrompt:
        media = prompt.get("multi_modal_data") or {}
        if not _has_urls(media):
            return await self.local.encode(prompt, mm_processor_kwargs, request_id)
        for kind, items in media.items():
            limit = self.cfg.limit_mm_per_prompt.get(kind, 0)
            if len(items) > limit:
                raise InvalidInputError(f"{len(items)} {kind}s in one prompt; at most {limit} allowed "
                                        f"(--limit-mm-per-prompt {kind}={limit})")
            if not self.cfg.enable_mm_embeds and any(isinstance(src, dict) for src in items):
                raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        if "prompt" not in prompt:
            raise InvalidInputError("a prompt with media needs its text (token ids cannot carry placeholders here)")
        processed = await self.client.encode(request_id or "prompt", prompt["prompt"], media,
                                             prompt.get("multi_modal_uuids") or {}, mm_processor_kwargs or {})
        blocks = processed.block_rows
        released = []

        def release() -> None:  # once: the engine is done with the rows (or never got them)
            if not released:
                released.append(True)
                self.client.free(blocks)

        return EncodedPrompt(processed, release)


def remote_prompt_encoder(opts: DisaggArgs, http_address: str):
    def build(engine) -> RemotePromptEncoder:
        return RemotePromptEncoder(engine, opts, http_address)
    return build


class _EncoderGauge:
    def __init__(self, client: EncoderClient):
        self.client = client

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("vlserve:encoders_available", "Encoders this language server can send work to.")
        g.add_metric([], float(self.client.num_available))
        yield g
