"""The language server's prompt encoder: prompts with media go to an encoder service, which fetches, preprocesses,
tokenizes, runs the vision encoder and sends the embeddings back; prompts without media stay local."""

from __future__ import annotations

from vlserve.core.config import DisaggArgs
from vlserve.core.errors import InvalidInputError
from vlserve.disagg.language_client import DisaggClient, make_language_client
from vlserve.frontend.prompt_encoder import EncodedPrompt, LocalPromptEncoder


def _has_urls(media: dict) -> bool:
    return any(isinstance(src, str) for items in media.values() for src in items)


class RemotePromptEncoder:
    def __init__(self, engine, client: DisaggClient):
        self.cfg = engine.cfg
        self.local = LocalPromptEncoder(engine.input_processor, {}, engine.executor)  # text and embeddings
        self.client = client

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    async def encode(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str) -> EncodedPrompt:
        media = prompt.get("multi_modal_data") or {}
        if not _has_urls(media):
            return await self.local.encode(prompt, mm_processor_kwargs, request_id)
        # What this server's options forbid is refused here, the same way the aggregated server refuses it.
        for kind, items in media.items():
            limit = self.cfg.limit_mm_per_prompt.get(kind, 0)
            if len(items) > limit:
                raise InvalidInputError(f"{len(items)} {kind}s in one prompt; at most {limit} allowed "
                                        "(limit_mm_per_prompt)")
            if not self.cfg.enable_mm_embeds and any(isinstance(src, dict) for src in items):
                raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        processed = await self.client.encode(request_id or "prep", prompt["prompt"], media,
                                             prompt.get("multi_modal_uuids") or {}, mm_processor_kwargs or {})
        return EncodedPrompt(processed)


def remote_prompt_encoder(opts: DisaggArgs, http_address: str):
    def build(engine) -> RemotePromptEncoder:
        return RemotePromptEncoder(engine, make_language_client(engine, opts, http_address))
    return build
