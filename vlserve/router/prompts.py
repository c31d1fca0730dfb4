"""A request's prefix-cache block hashes, computed in the router exactly as the replicas' engines compute them:
the server's chat parsing and template, the model's input processor in its layout-only form (tokenizer; media
fetched under the router's URL policy, decoded and hashed as the engine hashes them, token counts from their size,
no resize or patchify; `InputProcessor.layout`), then `prompt_block_hashes`. No model runs here. Data URLs go to
the processor as sent: the family's layout cache knows a re-sent picture by a hash of its text, so a chat's
later turns cost a lookup per picture rather than a decode. A picture the router has not seen yet is not decoded
on the request's path: the hint is then the blocks before it (nothing after it can be matched by its hash unless
the same picture came before), and its layout is made in the background for the chat's next turn.

A hash is only a hint: a request the router cannot process (a picture it may not fetch, a bad body part) is
routed by load with no overlap, and the replica answers it with its own verdict.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from vlserve.core.block_hash import chain_root, extend_block_hashes, prompt_block_hashes
from vlserve.core.lora import AdapterRef
from vlserve.core.config import Options
from vlserve.core.cpu_budget import cpu_budget, media_pool_size
from vlserve.core.errors import VlserveError
from vlserve.core.prompt import MEDIA_KINDS, ProcessedPrompt
from vlserve.frontend.chat import parse_chat_messages
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.tokenizer import load_chat_template, render_chat
from vlserve.media.data_url import is_data_url
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.lora.catalog import with_adapter
from vlserve.model.families.processor import NotLaidOut
from vlserve.model.facts import resolve_model_facts
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("vlserve.router")


class PromptHasher:
    def __init__(self, opts: Options):
        server = opts.server
        self.block_size = opts.engine.block_size
        # config files only
        facts = resolve_model_facts(opts.engine, runs_model=False, media=server.media_bounds())
        self.cfg = FrontendConfig.of(facts, opts.engine)
        self.processor = InputProcessor.for_model(self.cfg, **server.media_bounds())
        if server.chat_template is not None:
            self.processor.tokenizer.chat_template = load_chat_template(server.chat_template)
        self.trust_template = server.trust_request_chat_template
        self.executor = ThreadPoolExecutor(max_workers=media_pool_size(server.media_threads, cpu_budget().cpus),
                                           thread_name_prefix="vlserve-router")
        # Pictures seen for the first time are laid out here, one at a time: never ahead of requests' own work.
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-router-layout")
        self.fetchers = {kind: MediaFetcher(MediaPolicy.from_args(server, kind)) for kind in MEDIA_KINDS}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown(wait=False, cancel_futures=True)

    async def chat(self, body: ChatCompletionRequest, adapter: AdapterRef | None = None) -> tuple[list[bytes], bool]:
        return await self._hint(self._chat_prompt(body), body.mm_processor_kwargs, adapter)

    async def completion(self, body: CompletionRequest,
                         adapter: AdapterRef | None = None) -> tuple[list[bytes], bool]:
        prompts = body.prompts()  # n prompts: the first one's prefix is the hint (a batch goes to one replica)
        return await self._hint(asyncio.sleep(0, prompts[0]), None, adapter)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> dict:
        chat = parse_chat_messages(body.messages, allow_python_objects=False, modalities=self.cfg.model.modalities)
        template = body.chat_template if self.trust_template else None
        tools, _ = body.tool_setup()
        text = await asyncio.get_running_loop().run_in_executor(
            self.executor, render_chat, self.processor.tokenizer, chat.messages, body.add_generation_prompt,
            template, body.chat_template_kwargs, tools)
        return chat.prompt(text)

    async def _hint(self, prompt_work, mm_processor_kwargs: dict | None,
                    adapter: AdapterRef | None = None) -> tuple[list[bytes], bool]:
        """The block hashes, and whether they cover the whole prompt (else its size is unknown); with a LoRA
        adapter, the hashes a replica's prefix cache gives the prompt under that adapter."""
        try:
            prompt = await prompt_work
            if prompt.get("multi_modal_data"):
                prompt = {**prompt, "multi_modal_data": await self._fetch(prompt["multi_modal_data"])}
            processed = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._layout_or_prefix, prompt, mm_processor_kwargs)
        except VlserveError as e:
            logger.debug("no cache hint for this request (routed by load): %s", e)
            return [], False
        if isinstance(processed, list):
            hashes: list[bytes] = []
            extend_block_hashes(processed, [], self.block_size, hashes, [],
                                chain_root(adapter.key if adapter is not None else None))
            return hashes, False
        return prompt_block_hashes(with_adapter(processed, adapter), self.block_size), True

    def _layout_or_prefix(self, prompt: dict, mm_processor_kwargs: dict | None) -> ProcessedPrompt | list[int]:
        """The prompt's layout when every media item's is cached; else the token ids before the first item, the
        layout made in the background (a bad item shows there, and the replica tells the client)."""
        try:
            return self.processor.layout(prompt, mm_processor_kwargs, only_cached=True)
        except NotLaidOut:
            future = self.background.submit(self.processor.layout, prompt, mm_processor_kwargs)
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: the replica says why
            return self.processor.text_before_media(prompt)

    async def _fetch(self, media: dict[str, list]) -> dict[str, list]:
        """http(s) and file URLs fetched under their kind's policy; data URLs and embedding entries as sent."""
        async def one(kind: str, source):
            if kind not in self.fetchers or not isinstance(source, str) or is_data_url(source):
                return source
            return await self.fetchers[kind].fetch(source)

        return {kind: list(await asyncio.gather(*(one(kind, s) for s in sources))) for kind, sources in media.items()}
