"""Prompt (text or token ids, plus pictures, videos or precomputed embeddings) -> engine `Request`:
tokenize, preprocess, expand placeholders, M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlserve.core.config import DEFAULT_MAX_PIXELS_DECODED
from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.media.data_url import decode_base64
from vlserve.frontend.media.hashing import (
    hash_embeddings,
    hash_image,
    hash_user_id,
    hash_video,
    hash_video_patch,
)
from vlserve.frontend.media.image import (
    ImageProcessorConfig,
    load_image,
    preprocess_image,
    resolve_pixel_limits,
    smart_resize,
)
from vlserve.frontend.media.video import (
    VideoOptions,
    load_video,
    preprocess_video,
    video_grid,
)
from vlserve.frontend.mrope import MRopeItem, expand_all_placeholders, mrope_positions
from vlserve.frontend.tokenizer import load_tokenizer
from vlserve.frontend.video_layout import VideoLayout

MM_KWARGS = {"min_pixels", "max_pixels", "fps", "max_frames", "total_pixels"}
EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class _Item:
    """One media item before expansion: what the encoder gets (pixels, audio features or embeddings) and its
    token count."""

    num_tokens: int
    grid_thw: tuple[int, int, int]
    mm_hash: str
    pixel_values: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    time_interval: float = 1.0  # M-RoPE temporal spacing (videos)
    modality: str = "image"
    audio_features: torch.Tensor | None = None
    audio_len: int = 0

    def placed_at(self, offset: int) -> MultiModalItem:
        return MultiModalItem(offset, self.num_tokens, self.pixel_values, self.grid_thw, self.mm_hash,
                              self.embeddings, self.modality, self.audio_features, self.audio_len)


class InputProcessor:
    """`max_image_pixels` bounds every picture and video frame twice: as decoded (checked from the header,
    before decoding: a larger one is refused) and as resized for the encoder (the resize target shrinks to fit
    under it; checked again before resizing)."""

    def __init__(self, cfg: FrontendConfig, tokenizer, image_cfg: ImageProcessorConfig,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS_DECODED):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.image_cfg = image_cfg
        self.vocab_size = cfg.model.text.vocab_size
        self.max_image_pixels = max_image_pixels
        m = cfg.model
        self.video_opts = VideoOptions.for_model(cfg.model_path, m.video_rules, cfg.max_video_frames)
        # Qwen3-VL: each temporal patch of a video is its own item, after a timestamp written into the prompt
        self.video_layout = (VideoLayout(tokenizer, m.vision_start_token_id, m.video_token_id, m.vision_end_token_id)
                             if m.video_timestamps else None)
        # One media item must fit the encoder's per-step budget, its cache and the context.
        caps = {f"max_num_encoder_input_tokens={cfg.max_num_encoder_input_tokens}": cfg.max_num_encoder_input_tokens,
                f"max_model_len={cfg.max_model_len}": cfg.max_model_len}
        if cfg.encoder_cache_size:  # a token of a model with DeepStack features takes 1 + levels rows of it
            rows = cfg.model.rows_per_media_token
            name = f"encoder_cache_size={cfg.encoder_cache_size}" + (f" rows at {rows} per token" if rows > 1 else "")
            caps[name] = cfg.encoder_cache_size // rows
        self.item_token_limit = min(caps.items(), key=lambda kv: kv[1])  # (the option that sets it, tokens)
        # Any prompt longer than this many characters is longer than max_model_len tokens whatever it says:
        # refused before tokenizing (no token of this vocabulary is longer).
        self.max_prompt_chars = cfg.max_model_len * max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)

    @classmethod
    def for_model(cls, cfg: FrontendConfig, max_image_pixels: int = DEFAULT_MAX_PIXELS_DECODED) -> "InputProcessor":
        """With the checkpoint's own tokenizer and image-processor settings (every front-end starts this way)."""
        return cls(cfg, load_tokenizer(cfg.model_path), ImageProcessorConfig.from_pretrained(cfg.model_path),
                   max_image_pixels)

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
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidInputError("the prompt is empty")
        mm_data = (prompt.get("multi_modal_data") or {}) if isinstance(prompt, dict) else {}
        uuids = (prompt.get("multi_modal_uuids") or {}) if isinstance(prompt, dict) else {}
        unknown = set(mm_data) - {"image", "video"}
        if unknown:
            raise InvalidInputError(f"unsupported multi_modal_data kinds: {sorted(unknown)} (supported: image, video)")
        kwargs = mm_processor_kwargs or {}
        if set(kwargs) - MM_KWARGS:
            raise InvalidInputError(f"unsupported mm_processor_kwargs: {sorted(set(kwargs) - MM_KWARGS)} "
                                    f"(supported: {', '.join(sorted(MM_KWARGS))})")
        images = self._sources("image", mm_data, uuids)
        videos = self._sources("video", mm_data, uuids)
        min_px, max_px = resolve_pixel_limits(self.image_cfg, kwargs.get("min_pixels"), kwargs.get("max_pixels"),
                                              cap=self.max_image_pixels)
        if min_px > max(self.image_cfg.max_pixels, self.image_cfg.min_pixels):
            raise InvalidInputError(f"min_pixels {min_px} is above this model's max_pixels "
                                    f"({self.image_cfg.max_pixels})")
        pixel_params = {"min_pixels": min_px, "max_pixels": max_px}  # what changes the encoder's output
        image_items = [self._image(src, uid, pixel_params) for src, uid in images]
        per_video = [self._video(src, uid, kwargs, pixel_params) for src, uid in videos]
        video_items = [item for items, _ in per_video for item in items]
        if self.video_layout is not None and per_video:
            stamps = [timestamps for _, timestamps in per_video]
            if "prompt_token_ids" in prompt:  # (a prompt with media is always a dict)
                token_ids = self.video_layout.token_ids(token_ids, stamps)
            else:  # rewritten as text and tokenized again, as the reference processor does
                token_ids = self.tokenize({"prompt": self.video_layout.text(text, stamps)})[1]

        mcfg = self.cfg.model
        token_ids, offsets = expand_all_placeholders(token_ids, {
            mcfg.image_token_id: [it.num_tokens for it in image_items],
            mcfg.video_token_id: [it.num_tokens for it in video_items]})
        placed = sorted(zip(offsets[mcfg.image_token_id] + offsets[mcfg.video_token_id], image_items + video_items),
                        key=lambda x: x[0])
        positions, delta = mrope_positions(
            token_ids, [MRopeItem(off, it.grid_thw, it.time_interval) for off, it in placed],
            mcfg.vision.spatial_merge_size if mcfg.vision is not None else 1)
        mm_items = [it.placed_at(off) for off, it in placed]
        return ProcessedPrompt(token_ids, mm_items, positions, delta, text)

    def _sources(self, kind: str, mm_data: dict, uuids: dict) -> list[tuple[Any, str | None]]:
        value = mm_data.get(kind)
        items = [value] if isinstance(value, np.ndarray) else as_list(value)  # one [T, H, W, 3] video array
        limit = self.cfg.limit_mm_per_prompt.get(kind, 0)
        if len(items) > limit:
            raise InvalidInputError(f"{len(items)} {kind}s in one prompt; at most {limit} allowed "
                                    f"(limit_mm_per_prompt)")
        ids = as_list(uuids.get(kind))
        if ids and len(ids) != len(items):
            raise InvalidInputError(f"{len(ids)} {kind} uuids for {len(items)} {kind}s")
        return list(zip(items, ids or [None] * len(items)))

    def _image(self, src: Any, uid: str | None, params: dict) -> _Item:
        if isinstance(src, dict) and "image_embeds" in src:
            return self._embeds(src)
        img = load_image(src, self.max_image_pixels)
        h, w = smart_resize(img.height, img.width, self.image_cfg.factor, params["min_pixels"], params["max_pixels"])
        patch = self.image_cfg.patch_size
        self._check_size((1, h // patch, w // patch), "picture")
        p = preprocess_image(img, self.image_cfg, params["min_pixels"], params["max_pixels"])
        mm_hash = hash_user_id(str(uid), params) if uid else hash_image(img, params)
        return _Item(p.num_embed_tokens, p.grid_thw, mm_hash, pixel_values=p.pixel_values)

    def _video(self, src: Any, uid: str | None, kwargs: dict, pixel_params: dict) -> tuple[list[_Item], list[float]]:
        """The video's items: one, or with Qwen3-VL's layout one per temporal patch plus each patch's time in
        seconds (for the prompt)."""
        opts = self.video_opts.with_overrides(kwargs, self.cfg.max_video_frames, self.max_image_pixels)
        video = load_video(list(src) if isinstance(src, np.ndarray) else src, opts, self.max_image_pixels)
        lo, hi = pixel_params["min_pixels"], pixel_params["max_pixels"]
        t, h, w = video_grid(video, self.image_cfg, opts, lo, hi)
        # one item per temporal patch with Qwen3-VL's layout: each must fit the encoder on its own
        self._check_size((1, h, w) if self.video_layout is not None else (t, h, w), "video")
        p = preprocess_video(video, self.image_cfg, opts, lo, hi)
        params = {**pixel_params, "fps": opts.fps, "max_frames": opts.max_frames, "total_pixels": opts.total_pixels}
        mm_hash = hash_user_id(str(uid), params) if uid else hash_video(video.frames, params)
        if self.video_layout is not None:
            t, h, w = p.grid_thw
            rows = p.pixel_values.view(t, h * w, -1)
            return [_Item(h * w // self.image_cfg.merge_size**2, (1, h, w), hash_video_patch(mm_hash, k),
                          pixel_values=rows[k], modality="video") for k in range(t)], video.timestamps(self.image_cfg.temporal_patch_size)
        vision = self.cfg.model.vision
        interval = p.second_per_grid * vision.tokens_per_second if vision.time_scaled_video else 1.0
        return [_Item(p.num_embed_tokens, p.grid_thw, mm_hash, pixel_values=p.pixel_values,
                      time_interval=interval, modality="video")], []

    def _check_size(self, grid_thw: tuple[int, int, int], what: str) -> None:
        """Refuse a resized item that is too large before doing the resize."""
        t, h, w = grid_thw
        patch, merge = self.image_cfg.patch_size, self.image_cfg.merge_size
        if h * w * patch * patch > self.max_image_pixels:
            raise MediaTooLargeError(f"the {what} would be resized to {h * w * patch * patch} pixels per frame, more "
                                     f"than the {self.max_image_pixels} allowed (--max-image-pixels)")
        tokens = t * h * w // merge**2
        name, limit = self.item_token_limit
        if tokens > limit:
            raise InvalidInputError(f"the {what} would take {tokens} embedding tokens, more than the {limit} one item "
                                    f"may take here ({name}); lower max_pixels or send a smaller one")

    def _embeds(self, entry: dict) -> _Item:
        """Precomputed image embeddings: a tensor (or base64 safetensors) plus its image_grid_thw."""
        if not self.cfg.enable_mm_embeds:
            raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        embeds, grid = decode_embeds(entry.get("image_embeds")), entry.get("image_grid_thw")
        if isinstance(grid, torch.Tensor):
            grid = grid.flatten().tolist()
        merge = self.cfg.model.vision.spatial_merge_size
        if (not isinstance(grid, (list, tuple)) or len(grid) != 3 or not all(isinstance(g, int) and g > 0 for g in grid)
                or grid[1] % merge or grid[2] % merge):
            raise InvalidInputError(f"image_grid_thw must be 3 positive integers with h, w divisible by {merge}, "
                                    f"got {grid!r}")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        tokens = grid[0] * grid[1] * grid[2] // merge**2
        expected = (tokens, self.cfg.model.embedding_width)
        if tuple(embeds.shape) != expected:
            levels = len(self.cfg.model.vision.deepstack_indexes)
            layout = f" (the embedding, then {levels} DeepStack feature rows, side by side)" if levels else ""
            raise InvalidInputError(f"image_embeds has shape {tuple(embeds.shape)}; image_grid_thw {tuple(grid)} on "
                                    f"this model needs {expected}{layout}")
        if embeds.dtype not in EMBED_DTYPES:
            raise InvalidInputError(f"image_embeds dtype {embeds.dtype} is not float32, bfloat16 or float16")
        if not torch.isfinite(embeds).all():
            raise InvalidInputError("image_embeds holds NaN or infinite values")
        embeds = embeds.to(self.cfg.dtype).contiguous()
        grid = (grid[0], grid[1], grid[2])
        return _Item(tokens, grid, hash_embeddings(embeds, grid), embeddings=embeds)


def decode_embeds(value: Any) -> torch.Tensor:
    """A tensor as is; a string as base64 of a safetensors file holding one tensor (never a pickle)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if not isinstance(value, str):
        raise InvalidInputError("image_embeds must be a tensor or base64 of a safetensors file")
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(decode_base64(value))
    except (InvalidInputError, ValueError, SafetensorError) as e:
        raise InvalidInputError(f"image_embeds is not base64 of a safetensors file ({type(e).__name__})") from None
    if len(tensors) != 1 and "image_embeds" not in tensors:
        raise InvalidInputError(f"image_embeds safetensors must hold one tensor (or one named 'image_embeds'), "
                                f"got {sorted(tensors)[:5]}")
    return tensors.get("image_embeds", next(iter(tensors.values())))
