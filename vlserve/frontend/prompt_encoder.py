"""How a request's prompt becomes a `ProcessedPrompt`, behind one interface with two implementations:

- `LocalPromptEncoder`: this process fetches the media (under the server's URL policy), decodes, preprocesses,
  tokenizes and expands placeholders on a thread pool; the engine runs the vision encoder later.
- `disagg.remote_encoder.RemotePromptEncoder`: an encoder service does all that plus the vision encoder, and
  the embeddings arrive in this server's receive blocks.

The async client (`AsyncLLM`) gets one of them injected and never asks which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from vlserve.core.lora import AdapterRef
from vlserve.core.messages import Handoff
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.input_processor import InputProcessor
from vlserve.media.fetch import MediaFetcher


@dataclass
class EncodedPrompt:
    prompt: ProcessedPrompt
    # Frees what the prompt's rows occupy outside the engine (a disaggregated server's receive blocks). Called
    # once, by the prompt's one owner (`frontend.prepared_prompt.PreparedPrompt`, then the engine client): when
    # the engine is done with the prompt, or it never reached the engine.
    release: Callable[[], None] | None = None
    # Prefilled on another instance (a decode server's prompt): the first token and random state; the prompt's
    # `block_rows` then hold its KV rows.
    handoff: Handoff | None = None


class PromptEncoder(Protocol):
    # Receive blocks the engine process must map to read this encoder's output in place (None: none needed).
    transfer_buffers: TransferBuffers | None

    async def encode(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str,
                     params: SamplingParams | None = None, lora: AdapterRef | None = None,
                     peer: str | None = None) -> EncodedPrompt:
        """`prompt`: {"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {kind: [url, ...]},
        "multi_modal_uuids": {...}}; media sources are URLs (http(s), data:, file://) or embedding entries.
        `params`: the request's sampling parameters (all but a defaulted max_tokens), when known. `lora`: the
        request's LoRA adapter (an encoder elsewhere runs its towers with it; here the engine does). `peer`: the
        instance id of the peer to ask first, if paired (one that did the work already; unused here)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def not_ready_reason(self) -> str | None:
        """Why this server cannot yet serve what it accepts (no peer paired), or None."""


class LocalPromptEncoder:
    transfer_buffers = None

    def __init__(self, input_processor: InputProcessor, fetchers: dict[str, MediaFetcher], executor: Executor):
        self.input_processor = input_processor
        self.fetchers = fetchers  # media kind -> fetcher (each kind has its own size limit)
        self.executor = executor

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        for fetcher in self.fetchers.values():
            await fetcher.aclose()

    def not_ready_reason(self) -> str | None:
        return None

    async def encode(self, prompt: dict, mm_processor_kwargs: dict | None, request_id: str,
                     params: SamplingParams | None = None, lora: AdapterRef | None = None,
                     peer: str | None = None) -> EncodedPrompt:
        # `lora` and `peer` are not needed here: the engine runs the towers, with the adapter `generate` gives the prompt
        media = prompt.get("multi_modal_data") or {}
        if media:
            prompt = {**prompt, "multi_modal_data": await self.fetch_all(media)}
        loop = asyncio.get_running_loop()
        processed = await loop.run_in_executor(self.executor, self.input_processor.process, prompt,
                                               mm_processor_kwargs)
        return EncodedPrompt(processed)

    async def fetch_all(self, media: dict[str, list]) -> dict[str, list]:
        """Every URL fetched concurrently under its kind's policy; embedding entries pass through."""
        async def one(kind: str, source):
            if kind not in self.fetchers or not isinstance(source, str):
                return source  # the input processor refuses unknown kinds and checks embedding entries
            return await self.fetchers[kind].fetch(source)

        out = {}
        for kind, sources in media.items():
            out[kind] = list(await asyncio.gather(*(one(kind, s) for s in sources)))
        return out
