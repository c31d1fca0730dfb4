"""Prompt (text or token ids, plus pictures) -> engine `Request`: tokenize, preprocess, expand, positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlserve.config import VlserveConfig
from vlserve.engine.request import MultiModalItem, Request
from vlserve.errors import InvalidInputError
from vlserve.media.hashing import hash_image, hash_user_id
from vlserve.media.image import (DEFAULT_MAX_PIXELS_DECODED, ImageProcessorConfig, load_image, preprocess_image,
                                 resolve_pixel_limits)
from vlserve.processing.mrope import MRopeItem, expand_placeholders, mrope_positions
from vlserve.sampling_params import SamplingParams

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class InputProcessor:
    def __init__(self, cfg: VlserveConfig, tokenizer, image_cfg: ImageProcessorConfig):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.image_cfg = image_cfg
        self.vocab_size = cfg.model.text.vocab_size
        self.max_pixels_decoded = DEFAULT_MAX_PIXELS_DECODED  # bigger pictures are refused before decoding

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
        return text, self.tokenizer.encode(text)

    def process(
        self,
        request_id: str,
        prompt: dict | str,
        params: SamplingParams,
        mm_processor_kwargs: dict | None = None,
    ) -> tuple[str | None, Request]:
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidInputError("the prompt is empty")
        mm_data = prompt.get("multi_modal_data") or {} if isinstance(prompt, dict) else {}
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise InvalidInputError(f"unsupported multi_modal_data kinds: {sorted(unknown)} (supported: image)")
        images = as_list(mm_data.get("image"))
        limit = self.cfg.limit_mm_per_prompt.get("image", 0)
        if len(images) > limit:
            raise InvalidInputError(f"{len(images)} images in one prompt; at most {limit} allowed (limit_mm_per_prompt)")
        uuids = as_list((prompt.get("multi_modal_uuids") or {}).get("image")) if isinstance(prompt, dict) else []
        if uuids and len(uuids) != len(images):
            raise InvalidInputError(f"{len(uuids)} image uuids for {len(images)} images")
        items, hashes = self._images(images, uuids, mm_processor_kwargs or {})
        mcfg = self.cfg.model
        token_ids, offsets = expand_placeholders(token_ids, mcfg.image_token_id, [p.num_embed_tokens for p in items])
        merge = mcfg.vision.spatial_merge_size
        positions, delta = mrope_positions(
            token_ids, [MRopeItem(off, p.grid_thw) for off, p in zip(offsets, items)], merge
        )
        mm_items = [
            MultiModalItem(off, p.num_embed_tokens, p.pixel_values, p.grid_thw, h)
            for off, p, h in zip(offsets, items, hashes)
        ]
        req = Request(request_id, token_ids, params, mcfg.eos_token_ids, mm_items, positions, delta)
        return text, req

    def _images(self, images: Sequence[Any], uuids: Sequence[str | None], kwargs: dict) -> tuple[list, list[str]]:
        unknown = set(kwargs) - {"min_pixels", "max_pixels"}
        if unknown:
            raise InvalidInputError(f"unsupported mm_processor_kwargs: {sorted(unknown)} (supported: min_pixels, max_pixels)")
        min_px, max_px = resolve_pixel_limits(self.image_cfg, kwargs.get("min_pixels"), kwargs.get("max_pixels"))
        params = {"min_pixels": min_px, "max_pixels": max_px}  # what changes the encoder's output
        processed, hashes = [], []
        for i, src in enumerate(images):
            img = load_image(src, self.max_pixels_decoded)
            uid = uuids[i] if uuids else None
            hashes.append(hash_user_id(str(uid), params) if uid else hash_image(img, params))
            processed.append(preprocess_image(img, self.image_cfg, min_px, max_px))
        return processed, hashes
