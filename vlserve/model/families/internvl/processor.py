"""The InternVL family's request path: pictures cut into tiles (tiles.py) and videos as frames, each laid out in
the prompt as transformers' InternVLProcessor does, plain 1-D positions.

The chat template writes `<IMG_CONTEXT>` for a picture and `<video>` for a video. A picture becomes
`<img>` + its tiles' rows of `<IMG_CONTEXT>` + `</img>`; a video of F frames
`Frame1: <img>...</img>\\nFrame2: <img>...</img>...`, every frame one tile (resized to S x S) and its own item,
so frames are encoded and cached one by one. Prompts given as text are rewritten before tokenizing (as the
reference does, so the text around a video tokenizes as there); prompts given as token ids are rewritten in ids,
each `FrameN: ` and newline tokenized on its own.

Items: a picture's grid is (tiles, height, width), a frame's (1, 0, 0), precomputed picture embeddings
(--enable-mm-embeds: {"image_embeds": [rows, hidden]}, rows a multiple of a tile's) (rows / tile rows, 0, 0).
Bounds, checked before any pixel is resized: a picture's tiles from its header (its token count and its canvas
against --max-image-pixels); a video's frames (--max-video-frames, or `max_frames`) and token count.
Videos are sampled as the LLaVA family's are: every frame when there are at most `max_frames`, else that many
spread evenly (vLLM's default video loader).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.media.hashing import hash_embeddings, hash_image, hash_user_id, hash_video, hash_video_patch
from vlserve.media.image import load_image
from vlserve.media.video import VideoOptions, load_video
from vlserve.model.families.internvl.checks import MAX_SIDE
from vlserve.model.families.internvl.config import END_TOKEN, START_TOKEN, VIDEO_TOKEN, tile_tokens
from vlserve.model.families.internvl.pixels import PixelSettings, frame_pixels, load_settings, picture_pixels
from vlserve.model.families.internvl.tiles import canvas, num_tiles
from vlserve.model.families.processor import (
    EMBED_DTYPES,
    MediaItem,
    MediaItemCache,
    MultiModalProcessor,
    ProcessorContext,
    PromptMedia,
    decode_embeds,
    expand_placeholders,
    rope_positions,
)

MAX_TILES_KWARG = 64  # the most tiles a request's `max_patches` may ask for (12 by default; InternVL trains to 12)


class InternVLProcessor(MultiModalProcessor):
    mm_kwargs = frozenset({"max_frames", "max_patches"})
    max_image_side = MAX_SIDE

    def __init__(self, ctx: ProcessorContext, image: PixelSettings | None = None,
                 video: PixelSettings | None = None):
        super().__init__(ctx)
        m = ctx.model
        self.rows_per_tile = tile_tokens(m)
        self.image = image or load_settings(ctx.model_path, "image")
        self.video = video or load_settings(ctx.model_path, "video")
        tok = ctx.tokenizer
        self.context = getattr(tok, "context_image_token", None) or tok.convert_ids_to_tokens(m.image_token_id)
        self.start = getattr(tok, "start_image_token", None) or START_TOKEN
        self.end = getattr(tok, "end_image_token", None) or END_TOKEN
        self.video_mark = getattr(tok, "video_token", None) or VIDEO_TOKEN
        ids = [tok.convert_tokens_to_ids(t) for t in (self.context, self.start, self.end, self.video_mark)]
        self.context_id, self.start_id, self.end_id, self.video_id = ids
        size = int(m.setting("tile_size"))
        if self.context_id != m.image_token_id or min(ids) < 0 or None in ids:
            raise ModelLoadError(f"{ctx.model_path}: the tokenizer's {self.context} / {self.start} / {self.end} / "
                                 f"{self.video_mark} ids {ids} do not fit the model's image token "
                                 f"{m.image_token_id}")
        for kind, s in (("image", self.image), ("video", self.video)):
            if s.tile != size:
                raise ModelLoadError(f"{ctx.model_path}: the {kind} processor makes {s.tile}px tiles; the vision "
                                     f"tower reads {size}px")
        self.marks = re.compile(f"({re.escape(self.context)})|({re.escape(self.video_mark)})")
        self.image_params = {"internvl": "image", **self.image.hash_params()}
        self.video_params = {"internvl": "video", **self.video.hash_params()}

    def process(self, prompt: PromptMedia) -> ProcessedPrompt:
        return self._run(prompt, pixels=True)

    def layout(self, prompt: PromptMedia) -> ProcessedPrompt:
        """No resizing: a picture's tiles follow from its decoded size; items seen before come from `layouts`."""
        return self._run(prompt, pixels=False)

    def _run(self, prompt: PromptMedia, pixels: bool) -> ProcessedPrompt:
        settings = self._image_settings(prompt.mm_kwargs)
        max_frames = self.max_frames(prompt.mm_kwargs)
        images = [self._image(src, uid, settings, pixels) for src, uid in prompt.media.get("image", [])]
        videos = [self._video(src, uid, max_frames, pixels) for src, uid in prompt.media.get("video", [])]
        if prompt.text is not None and not prompt.from_token_ids:
            ids, order = self._rewrite_text(prompt, [len(v) for v in videos])
        else:
            ids, order = self._rewrite_ids(prompt, [len(v) for v in videos])
        images_left, videos_left = iter(images), iter(videos)
        items = [it for kind in order for it in ([next(images_left)] if kind == "image" else next(videos_left))]
        ids, offsets = expand_placeholders(ids, self.context_id, [it.num_tokens for it in items])
        positions, delta = rope_positions(len(ids))
        return ProcessedPrompt(ids, [it.placed_at(off) for off, it in zip(offsets, items)], positions, delta,
                               prompt.text)

    # ---- the prompt's layout ------------------------------------------------------------------------------------
    def _check_counts(self, found: list[str], images: int, videos: int) -> None:
        for kind, given, mark in (("image", images, self.context), ("video", videos, self.video_mark)):
            n = found.count(kind)
            if n != given:
                raise InvalidInputError(f"prompt has {n} {mark} placeholder(s) but {given} {kind}(s) were provided")

    def _rewrite_text(self, prompt: PromptMedia, frames: list[int]) -> tuple[list[int], list[str]]:
        """The text with every picture and video laid out (one <IMG_CONTEXT> per picture or frame), tokenized."""
        text, out, order, pos = prompt.text, [], [], 0
        frames_left = iter(frames)
        for match in self.marks.finditer(text):
            order.append("image" if match.group(1) else "video")
        self._check_counts(order, len(prompt.media.get("image", [])), len(frames))
        picture = self.start + self.context + self.end
        for match in self.marks.finditer(text):
            out.append(text[pos:match.start()])
            out.append(picture if match.group(1) else
                       "\n".join(f"Frame{i + 1}: {picture}" for i in range(next(frames_left))))
            pos = match.end()
        out.append(text[pos:])
        return prompt.tokenize("".join(out)), order

    def _rewrite_ids(self, prompt: PromptMedia, frames: list[int]) -> tuple[list[int], list[str]]:
        order = [("image" if t == self.context_id else "video") for t in prompt.token_ids
                 if t in (self.context_id, self.video_id)]
        self._check_counts(order, len(prompt.media.get("image", [])), len(frames))
        picture = [self.start_id, self.context_id, self.end_id]
        newline = prompt.tokenize("\n")
        out: list[int] = []
        frames_left = iter(frames)
        for t in prompt.token_ids:
            if t == self.context_id:
                out += picture
            elif t == self.video_id:
                for i in range(next(frames_left)):
                    out += (newline if i else []) + prompt.tokenize(f"Frame{i + 1}: ") + picture
            else:
                out.append(t)
        return out, order

    # ---- pictures ----------------------------------------------------------------------------------------------
    def _image_settings(self, kwargs: dict) -> PixelSettings:
        v = kwargs.get("max_patches")
        if v is None:
            return self.image
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TILES_KWARG:
            raise InvalidInputError(f"max_patches must be an integer in 1..{MAX_TILES_KWARG}, got {v!r}")
        if self.image.max_tiles <= 1:
            raise InvalidInputError("max_patches: this checkpoint's image processor does not tile pictures")
        # below the checkpoint's min_patches no arrangement fits: one tile, as transformers then makes
        return PixelSettings(**{**self.image.__dict__, "max_tiles": v})

    def _image(self, src: Any, uid: str | None, s: PixelSettings, pixels: bool) -> MediaItem:
        if isinstance(src, dict) and "image_embeds" in src:
            return self._embeds(src)
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(MediaItemCache.key("image", src, [uid, s.max_tiles]),
                                 lambda: self._load_image(src, uid, s, pixels))

    def _load_image(self, src: Any, uid: str | None, s: PixelSettings, pixels: bool) -> MediaItem:
        img = load_image(src, self.image_bounds, lambda w, h: self._tiles(h, w, s))  # checked undecoded
        tiles = self._tiles(img.height, img.width, s)
        params = {**self.image_params, "max_tiles": s.max_tiles, "min_tiles": s.min_tiles}
        mm_hash = hash_user_id(str(uid), params) if uid else hash_image(img, params)
        return MediaItem(tiles * self.rows_per_tile, (tiles, img.height, img.width), mm_hash, "image",
                         pixel_values=picture_pixels(img, s) if pixels else None)

    def _tiles(self, height: int, width: int, s: PixelSettings) -> int:
        """A picture's tiles, bounded (its tokens, its canvas): from its size alone."""
        tiles = num_tiles(height, width, s.tile, s.min_tiles, s.max_tiles)
        self.ctx.check_item_tokens(tiles * self.rows_per_tile, f"{width}x{height} picture",
                                   hint="send a smaller one or fewer tiles (max_patches)")
        cols, rows = canvas(height, width, s.tile, s.min_tiles, s.max_tiles) if s.max_tiles > 1 else (1, 1)
        pixels = cols * rows * s.tile * s.tile
        if pixels > self.ctx.max_image_pixels:
            raise MediaTooLargeError(f"the {width}x{height} picture would be resized to {cols * s.tile}x"
                                     f"{rows * s.tile} = {pixels} pixels, more than the {self.ctx.max_image_pixels} "
                                     f"allowed (--max-image-pixels)")
        return tiles

    def _embeds(self, entry: dict) -> MediaItem:
        """Precomputed picture embeddings: {"image_embeds": [rows, hidden] (or base64 of a safetensors file)}, rows
        a multiple of one tile's (the projector's output for each tile, the thumbnail last)."""
        if not self.ctx.enable_mm_embeds:
            raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        embeds = decode_embeds(entry.get("image_embeds"))
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        width, per_tile = self.ctx.model.embedding_width, self.rows_per_tile
        if embeds.dim() != 2 or embeds.shape[1] != width or embeds.shape[0] == 0 or embeds.shape[0] % per_tile:
            raise InvalidInputError(f"image_embeds has shape {tuple(embeds.shape)}; this model takes [rows, {width}] "
                                    f"with rows a multiple of {per_tile} (one tile's)")
        self.ctx.check_item_tokens(embeds.shape[0], "picture's embeddings")
        if embeds.dtype not in EMBED_DTYPES:
            raise InvalidInputError(f"image_embeds dtype {embeds.dtype} is not float32, bfloat16 or float16")
        if not torch.isfinite(embeds).all():
            raise InvalidInputError("image_embeds holds NaN or infinite values")
        embeds = embeds.to(self.ctx.dtype).contiguous()
        grid = (embeds.shape[0] // per_tile, 0, 0)
        return MediaItem(embeds.shape[0], grid, hash_embeddings(embeds, grid), "image", embeddings=embeds)

    # ---- videos ------------------------------------------------------------------------------------------------
    def _video(self, src: Any, uid: str | None, max_frames: int, pixels: bool) -> list[MediaItem]:
        if isinstance(src, dict):
            raise InvalidInputError("precomputed video embeddings are not supported for InternVL models; send the "
                                    "video itself")
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(MediaItemCache.key("video", src, [uid, max_frames]),
                                 lambda: self._load_video(src, uid, max_frames, pixels))

    def _load_video(self, src: Any, uid: str | None, max_frames: int, pixels: bool) -> list[MediaItem]:
        if isinstance(src, np.ndarray):
            if src.ndim != 4:
                raise InvalidInputError(f"a video array must be [frames, height, width, 3], got shape {src.shape}")
            src = list(src)
        frames = load_video(src, VideoOptions(max_frames=max_frames, min_frames=1), self.image_bounds).frames
        n, side = len(frames), self.video.tile
        # each frame is its own item (one tile): the clip as a whole is bounded by the context
        if n * self.rows_per_tile > self.ctx.max_model_len:
            raise InvalidInputError(f"the video of {n} frames would take {n * self.rows_per_tile} embedding tokens, "
                                    f"more than the context holds (max_model_len={self.ctx.max_model_len}); send "
                                    f"fewer frames (max_frames)")
        self.ctx.check_item_tokens(self.rows_per_tile, "video frame")
        if side * side > self.ctx.max_image_pixels:
            raise MediaTooLargeError(f"the video's frames would be resized to {side}x{side} = {side * side} pixels, "
                                     f"more than the {self.ctx.max_image_pixels} allowed (--max-image-pixels)")
        # a uuid stands for the whole clip, so its hash also holds how many frames were taken from it
        clip = (hash_user_id(str(uid), {**self.video_params, "max_frames": max_frames}) if uid
                else hash_video(frames, self.video_params))
        rows = frame_pixels(frames, self.video) if pixels else None
        return [MediaItem(self.rows_per_tile, (1, 0, 0), hash_video_patch(clip, k), "video",
                          pixel_values=rows[k:k + 1] if rows is not None else None) for k in range(n)]
