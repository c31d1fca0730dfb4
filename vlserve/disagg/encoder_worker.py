"""The encoder role's compute: vision tower, preprocessing and tokenizer, no language model.

`encode()` turns one prompt with media into what the language server needs per token: fill ids (placeholders
expanded), M-RoPE positions, and embedding rows (the ViT output at media tokens, zeros at text), plus the
items' metadata and the rope delta. Pictures already encoded are served from a small LRU cache by mm_hash.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vlserve.core.config import EngineArgs
from vlserve.disagg.messages import ItemMeta
from vlserve.engine.config import resolve_config
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.media.image import ImageProcessorConfig
from vlserve.frontend.tokenizer import load_tokenizer
from vlserve.model.layers.packed_linear import packed_linear_supported
from vlserve.model.loader import load_model

logger = logging.getLogger("vlserve.encode")


@dataclass
class EncodedPrompt:
    fill_ids: torch.Tensor  # [L] int64
    positions: torch.Tensor  # [3, L] int64
    embeddings: torch.Tensor  # [L, hidden]
    items: list[ItemMeta]
    mrope_delta: int

    @property
    def num_tokens(self) -> int:
        return int(self.fill_ids.shape[0])


class EncoderWorker:
    def __init__(self, args: EngineArgs):
        self.cfg = resolve_config(args)
        self.tokenizer = load_tokenizer(self.cfg.model_path)
        self.input_processor = InputProcessor(self.cfg, self.tokenizer,
                                              ImageProcessorConfig.from_pretrained(self.cfg.model_path))
        self.model = load_model(self.cfg.model_path, self.cfg.model, self.cfg.dtype, self.cfg.device,
                                with_language=False)
        if packed_linear_supported(self.cfg.device, self.cfg.dtype):
            self.model.pack_for_cpu()
        self.hidden = self.cfg.model.text.hidden_size
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_tokens = 0
        self.cache_queries = self.cache_hits = 0
        self.encoder_seconds: list[float] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    @torch.inference_mode()
    def encode(self, prompt: str, media: dict, uuids: dict, mm_kwargs: dict) -> EncodedPrompt:
        """Runs in a worker thread; raises InvalidInputError for bad media (the request's fault)."""
        data = {"prompt": prompt, "multi_modal_data": media}
        if any(any(v) for v in uuids.values()):
            data["multi_modal_uuids"] = uuids
        req = self.input_processor.process(data, mm_kwargs)
        embeds = {}
        todo = []
        for it in req.mm_items:
            self.cache_queries += 1
            if it.embeddings is not None:
                embeds[it.mm_hash] = it.embeddings
            elif it.mm_hash in self.cache:
                self.cache_hits += 1
                self.cache.move_to_end(it.mm_hash)
                embeds[it.mm_hash] = self.cache[it.mm_hash]
            elif it.mm_hash not in {t.mm_hash for t in todo}:
                todo.append(it)
        if todo:
            t0 = time.perf_counter()
            pixels = torch.cat([it.pixel_values for it in todo]).to(self.cfg.device)
            for it, emb in zip(todo, self.model.encode_images(pixels, [it.grid_thw for it in todo])):
                embeds[it.mm_hash] = emb.to("cpu")
                self._remember(it.mm_hash, embeds[it.mm_hash])
            self.encoder_seconds.append(time.perf_counter() - t0)
        rows = torch.zeros(req.num_tokens, self.hidden, dtype=self.dtype)
        for it in req.mm_items:
            rows[it.offset:it.end] = embeds[it.mm_hash].to(self.dtype)
        items = [ItemMeta(it.offset, it.num_tokens, tuple(it.grid_thw), it.mm_hash) for it in req.mm_items]
        return EncodedPrompt(torch.tensor(req.prompt_token_ids, dtype=torch.int64), req.mrope_positions.long(), rows,
                             items, req.mrope_delta)

    def _remember(self, key: str, emb: torch.Tensor) -> None:
        capacity = self.cfg.encoder_cache_size
        if emb.shape[0] > capacity:
            return
        self.cache[key] = emb
        self.cache_tokens += emb.shape[0]
        while self.cache_tokens > capacity:
            _, old = self.cache.popitem(last=False)
            self.cache_tokens -= old.shape[0]
