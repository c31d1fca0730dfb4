"""Prompt (text or token ids, plus pictures, videos, audio or precomputed embeddings) -> `ProcessedPrompt`.

What is the same for every model family happens here: tokenizing (bounded before the tokenizer runs), the kinds and
number of media (`limit_mm_per_prompt`), the clients' uuids, which mm_processor_kwargs are known. The rest (loading
and preprocessing the media, placeholders, positions) is the model family's `MultiModalProcessor`
(vlserve.model.families)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vlserve.core.config import DEFAULT_MAX_AUDIO_SECONDS, DEFAULT_MAX_PIXELS_DECODED
from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.frontend.config import FrontendConfig
from vlserve.media.audio import audio_items
from vlserve.model.families import family_of
from vlserve.model.families.processor import MultiModalProcessor, ProcessorContext, PromptMedia
from vlserve.model.tokenizer_files import load_tokenizer


def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def processor_context(cfg: FrontendConfig, tokenizer, max_image_pixels: int = DEFAULT_MAX_PIXELS_DECODED,
                      max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS, max_media_bytes: int = 20 * 2**20,
                      max_video_bytes: int = 200 * 2**20, processed_cache_bytes: int = 0) -> ProcessorContext:
    # One media item must fit the encoder's per-step budget, its cache and the context.
    caps = {f"max_num_encoder_input_tokens={cfg.max_num_encoder_input_tokens}": cfg.max_num_encoder_input_tokens,
            f"max_model_len={cfg.max_model_len}": cfg.max_model_len}
    if cfg.encoder_cache_size:  # a token of a model with DeepStack features takes 1 + levels rows of it
        rows = cfg.model.rows_per_media_token
        name = f"encoder_cache_size={cfg.encoder_cache_size}" + (f" rows at {rows} per token" if rows > 1 else "")
        caps[name] = cfg.encoder_cache_size // rows
    return ProcessorContext(cfg.model, cfg.model_path, tokenizer, cfg.dtype, cfg.max_model_len,
                            min(caps.items(), key=lambda kv: kv[1]), max_image_pixels, cfg.max_video_frames,
                            cfg.enable_mm_embeds, max_audio_seconds, max_media_bytes, max_video_bytes,
                            processed_cache_bytes)


class InputProcessor:
    def __init__(self, cfg: FrontendConfig, tokenizer, processor: MultiModalProcessor):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.processor = processor
        self.vocab_size = cfg.model.text.vocab_size
        self.modalities = cfg.model.modalities
        # Any prompt longer than this many characters is longer than max_model_len tokens whatever it says:
        # refused before tokenizing (no token of this vocabulary is longer).
        self.max_prompt_chars = cfg.max_model_len * max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)

    @classmethod
    def for_model(cls, cfg: FrontendConfig, max_image_pixels: int = DEFAULT_MAX_PIXELS_DECODED,
                  **audio_bounds) -> "InputProcessor":
        """With the checkpoint's own tokenizer and its family's processor (every front-end starts this way).
        `audio_bounds`: max_audio_seconds, max_media_bytes, max_video_bytes, processed_cache_bytes."""
        tokenizer = load_tokenizer(cfg.model_path)
        family = family_of(cfg.model.architecture)
        ctx = processor_context(cfg, tokenizer, max_image_pixels, **audio_bounds)
        return cls(cfg, tokenizer, family.load(family.processor)(ctx))

    def tokenize(self, prompt: dict | str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidInputError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidInputError(f"prompt_token_ids holds ids outside the vocabulary: {bad[:5]}")
            return prompt.get("prompt"), ids
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise InvalidInputError("prompt dict needs a 'prompt' string or 'prompt_token_ids'")
        if len(text) > self.max_prompt_chars:
            raise InvalidInputError(f"the prompt has {len(text)} characters, more than can fit in the model's "
                                    f"context of {self.cfg.max_model_len} tokens")
        try:
            return text, self.tokenizer.encode(text)
        except UnicodeEncodeError:
            raise InvalidInputError("the prompt is not valid unicode (it holds a lone surrogate)") from None

    def process(self, prompt: dict | str, mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        return self.processor.process(self._prompt_media(prompt, mm_processor_kwargs))

    def layout(self, prompt: dict | str, mm_processor_kwargs: dict | None = None,
               only_cached: bool = False) -> ProcessedPrompt:
        """`process` without the encoder inputs (the family's `layout`): the same token ids, items and so block
        hashes, for a router. Data URLs may be given as they came: a re-sent one is then a cache lookup.
        `only_cached`: raise NotLaidOut rather than decode an item whose layout is not cached."""
        media = self._prompt_media(prompt, mm_processor_kwargs)
        if not only_cached:
            return self.processor.layout(media)
        with self.processor.layouts.only_cached():
            return self.processor.layout(media)

    def text_before_media(self, prompt: dict | str) -> list[int]:
        """The prompt's token ids before its first media placeholder: the same whatever the media turn out to be."""
        _, ids = self.tokenize(prompt)
        m = self.cfg.model
        pads = {m.image_token_id, m.video_token_id, m.audio_token_id}
        return ids[:next((i for i, t in enumerate(ids) if t in pads), len(ids))]

    def _prompt_media(self, prompt: dict | str, mm_processor_kwargs: dict | None) -> PromptMedia:
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidInputError("the prompt is empty")
        mm_data = (prompt.get("multi_modal_data") or {}) if isinstance(prompt, dict) else {}
        uuids = (prompt.get("multi_modal_uuids") or {}) if isinstance(prompt, dict) else {}
        unknown = set(mm_data) - set(self.modalities)
        if unknown:
            raise InvalidInputError(f"unsupported multi_modal_data kinds: {sorted(unknown)} (this model takes: "
                                    f"{', '.join(self.modalities)})")
        kwargs = mm_processor_kwargs or {}
        known = self.processor.mm_kwargs
        if set(kwargs) - known:
            raise InvalidInputError(f"unsupported mm_processor_kwargs: {sorted(set(kwargs) - known)} "
                                    f"(supported: {', '.join(sorted(known)) or 'none for this model'})")
        media = {kind: self._sources(kind, mm_data, uuids) for kind in self.modalities}
        from_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt
        return PromptMedia(text, token_ids, media, dict(kwargs), from_ids, lambda t: self.tokenize({"prompt": t})[1])

    def _sources(self, kind: str, mm_data: dict, uuids: dict) -> list[tuple[Any, str | None]]:
        value = mm_data.get(kind)
        if kind == "audio":  # a bare (waveform, rate) tuple is one clip
            items = audio_items(value)
        else:
            items = [value] if isinstance(value, np.ndarray) else as_list(value)  # one [T, H, W, 3] video array
        limit = self.cfg.limit_mm_per_prompt.get(kind, 0)
        if len(items) > limit:
            raise InvalidInputError(f"{len(items)} {kind}s in one prompt; at most {limit} allowed "
                                    f"(--limit-mm-per-prompt {kind}={limit}; offline, LLM(limit_mm_per_prompt=...))")
        ids = as_list(uuids.get(kind))
        if ids and len(ids) != len(items):
            raise InvalidInputError(f"{len(ids)} {kind} uuids for {len(items)} {kind}s")
        return list(zip(items, ids or [None] * len(items)))
