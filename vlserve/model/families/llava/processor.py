"""The LLaVA family's request path (LLaVA-OneVision, LLaVA-NeXT-Video): pictures cut "anyres" into tiles, videos
as whole frames, each `<image>` / `<video>` placeholder expanded to its item's rows, plain 1-D positions.

A picture becomes one item: pixel values float32 [num_tiles, 3 * S * S] (the base tile, then the anyres tiles),
grid (num_tiles, original_height, original_width); every picture is tiled, as vLLM and HF's processor do for
pictures sent one per list entry. A video becomes one item: [num_frames, 3 * S * S], grid (num_frames, 0, 0).
Token counts are the model's (`checks.item_tokens`: image_newline rows included), pixel values HF's
(vlserve.model.families.llava.pixels). Precomputed picture embeddings (--enable-mm-embeds) come as
{"image_embeds": [rows, hidden], "image_sizes": (height, width)}: the picture's size gives its grid and rows.

Videos: a clip (bytes, path, data URL; decoded with PyAV) keeps every frame when it has at most `max_frames`, else
`max_frames` frames spread evenly (np.linspace(0, total - 1, max_frames) truncated): vLLM's default video loader,
whose `num_frames` is 32 (`--max-video-frames`, 32 by default, here). A video given as frames (a [T, H, W, 3]
uint8 array or a list of frames) is used whole, as vLLM and HF do, when it has at most `max_frames` frames;
a longer one is sampled the same way (vLLM would encode every frame: unbounded). `max_frames` is the
mm_processor_kwargs entry when given (at most --max-video-frames, else refused), else --max-video-frames.

Bounds. A picture's are all checked from its header, before it is decoded: its pixels (--max-image-pixels), each
side (`MAX_SIDE`, what the engine's check of its grid takes), its token count (`ctx.check_item_tokens`, from the
geometry alone) and its anyres canvas (its best grid pinpoint) against --max-image-pixels. A video's: frames and
pixels per frame as decoded (vlserve.media), then its token count and a frame's resized size before any resize.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.media.hashing import hash_embeddings, hash_image, hash_user_id, hash_video
from vlserve.media.image import load_image
from vlserve.media.video import VideoOptions, load_video
from vlserve.model.families.llava.anyres import Geometry
from vlserve.model.families.llava.checks import MAX_SIDE, item_tokens
from vlserve.model.families.llava.pixels import (
    PixelSettings,
    anyres_pixels,
    canvas_size,
    frame_size,
    load_settings,
    video_pixels,
)
from vlserve.model.families.processor import (
    EMBED_DTYPES,
    MediaItem,
    MediaItemCache,
    MultiModalProcessor,
    ProcessorContext,
    PromptMedia,
    decode_embeds,
    expand_all_placeholders,
    rope_positions,
)


class LlavaProcessor(MultiModalProcessor):
    mm_kwargs = frozenset({"max_frames"})
    max_image_side = MAX_SIDE  # what the engine's check of a picture's grid takes (checks.check_grid)

    def __init__(self, ctx: ProcessorContext, image: PixelSettings | None = None,
                 video: PixelSettings | None = None):
        """`image` / `video`: the HF processors' settings (read from the checkpoint when not given)."""
        super().__init__(ctx)
        m = ctx.model
        self.geo = Geometry.of(m)
        self.image = image or load_settings(ctx.model_path, m.architecture, "image")
        self.video = video or load_settings(ctx.model_path, m.architecture, "video")
        if not self.image.pinpoints:  # the processor config leaves them out: the model's
            self.image = replace(self.image, pinpoints=self.geo.pinpoints)
        self._check_agrees()
        self.image_params = {"llava": "image", **self.image.hash_params()}
        self.video_params = {"llava": "video", **self.video.hash_params()}

    def _check_agrees(self) -> None:
        """The processor settings must make what the model reads (its tile side, its pinpoints)."""
        size, where = self.geo.image_size, f"{self.ctx.model_path}"
        for kind, s in (("image", self.image), ("video", self.video)):
            if s.out_side != size:
                raise ModelLoadError(f"{where}: the {kind} processor makes {s.out_side}px tiles; the vision tower "
                                     f"reads {size}px")
        if self.image.tile != size or tuple(self.image.pinpoints) != tuple(self.geo.pinpoints):
            raise ModelLoadError(f"{where}: the image processor's grid pinpoints {list(self.image.pinpoints)} (tiles "
                                 f"of {self.image.tile}px) differ from the model's {list(self.geo.pinpoints)}")

    def process(self, prompt: PromptMedia) -> ProcessedPrompt:
        return self._run(prompt, pixels=True)

    def layout(self, prompt: PromptMedia) -> ProcessedPrompt:
        """No tiling or resizing: token counts follow from the decoded size (decoding stays: the content hash is
        of the decoded pixels, as the engine's); items seen before come from `self.layouts`."""
        return self._run(prompt, pixels=False)

    def _run(self, prompt: PromptMedia, pixels: bool) -> ProcessedPrompt:
        m = self.ctx.model
        max_frames = self.max_frames(prompt.mm_kwargs)
        images = [self._image(src, uid, pixels) for src, uid in prompt.media.get("image", [])]
        videos = [self._video(src, uid, max_frames, pixels) for src, uid in prompt.media.get("video", [])]
        token_ids, offsets = expand_all_placeholders(prompt.token_ids, {
            m.image_token_id: [it.num_tokens for it in images],
            m.video_token_id: [it.num_tokens for it in videos]})
        placed = sorted([*zip(offsets[m.image_token_id], images), *zip(offsets[m.video_token_id], videos)],
                        key=lambda x: x[0])
        positions, delta = rope_positions(len(token_ids))
        return ProcessedPrompt(token_ids, [it.placed_at(off) for off, it in placed], positions, delta, prompt.text)

    # ---- pictures ----------------------------------------------------------------------------------------------
    def _image(self, src: Any, uid: str | None, pixels: bool = True) -> MediaItem:
        if isinstance(src, dict) and "image_embeds" in src:
            return self._embeds(src)
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(MediaItemCache.key("image", src, [uid]), lambda: self._load_image(src, uid, pixels))

    def _load_image(self, src: Any, uid: str | None, pixels: bool) -> MediaItem:
        img = load_image(src, self.image_bounds, lambda w, h: self._geometry(h, w))  # checked undecoded
        grid, tokens = self._geometry(img.height, img.width)
        mm_hash = hash_user_id(str(uid), self.image_params) if uid else hash_image(img, self.image_params)
        return MediaItem(tokens, grid, mm_hash, "image",
                         pixel_values=anyres_pixels(img, self.image) if pixels else None)

    def _geometry(self, height: int, width: int) -> tuple[tuple[int, int, int], int]:
        """A picture's grid and token count, both bounded (its tokens, its anyres canvas): from its size alone."""
        grid = (self.geo.num_tiles(height, width), height, width)
        tokens = item_tokens(self.ctx.model, grid)
        self.ctx.check_item_tokens(tokens, f"{width}x{height} picture")
        bh, bw = canvas_size(height, width, self.image)
        if bh * bw > self.ctx.max_image_pixels:
            raise MediaTooLargeError(f"the {width}x{height} picture would be resized to {bw}x{bh} = {bh * bw} "
                                     f"pixels, more than the {self.ctx.max_image_pixels} allowed (--max-image-pixels)")
        return grid, tokens

    def _embeds(self, entry: dict) -> MediaItem:
        """Precomputed picture embeddings: {"image_embeds": [tokens, hidden] tensor (or base64 of a safetensors
        file), "image_sizes": (height, width) of the picture}: its tile count and rows follow from the size."""
        if not self.ctx.enable_mm_embeds:
            raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        embeds, size = decode_embeds(entry.get("image_embeds")), entry.get("image_sizes")
        if isinstance(size, torch.Tensor):
            size = size.flatten().tolist()
        if (not isinstance(size, (list, tuple)) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SIDE for v in size)):
            raise InvalidInputError(f"image_embeds need image_sizes: the picture's (height, width) in pixels, two "
                                    f"integers in 1..{MAX_SIDE}; got {size!r}")
        h, w = size
        grid = (self.geo.num_tiles(h, w), h, w)
        tokens = item_tokens(self.ctx.model, grid)
        self.ctx.check_item_tokens(tokens, f"{w}x{h} picture's embeddings")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        expected = (tokens, self.ctx.model.embedding_width)
        if tuple(embeds.shape) != expected:
            raise InvalidInputError(f"image_embeds has shape {tuple(embeds.shape)}; a {h}x{w} picture on this model "
                                    f"takes {expected} (image_newline rows included)")
        if embeds.dtype not in EMBED_DTYPES:
            raise InvalidInputError(f"image_embeds dtype {embeds.dtype} is not float32, bfloat16 or float16")
        if not torch.isfinite(embeds).all():
            raise InvalidInputError("image_embeds holds NaN or infinite values")
        embeds = embeds.to(self.ctx.dtype).contiguous()
        return MediaItem(tokens, grid, hash_embeddings(embeds, grid), "image", embeddings=embeds)

    # ---- videos ------------------------------------------------------------------------------------------------
    def _video(self, src: Any, uid: str | None, max_frames: int, pixels: bool = True) -> MediaItem:
        if isinstance(src, dict):
            raise InvalidInputError("precomputed video embeddings are not supported for LLaVA models; send the "
                                    "video itself")
        key = MediaItemCache.key("video", src, [uid, max_frames])
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(key, lambda: self._load_video(src, uid, max_frames, pixels))

    def _load_video(self, src: Any, uid: str | None, max_frames: int, pixels: bool) -> MediaItem:
        if isinstance(src, np.ndarray):
            if src.ndim != 4:
                raise InvalidInputError(f"a video array must be [frames, height, width, 3], got shape {src.shape}")
            src = list(src)
        opts = VideoOptions(max_frames=max_frames, min_frames=1)  # uniform_frame_indices: vLLM's loader
        video = load_video(src, opts, self.image_bounds)
        frames = video.frames
        (height, width), n = frames[0].shape[:2], len(frames)
        grid = (n, 0, 0)
        tokens = item_tokens(self.ctx.model, grid)
        self.ctx.check_item_tokens(tokens, f"video of {n} frames", hint="send fewer frames (max_frames)")
        rh, rw = frame_size(height, width, self.video)
        if rh * rw > self.ctx.max_image_pixels:
            raise MediaTooLargeError(f"the video's {width}x{height} frames would be resized to {rw}x{rh} = {rh * rw} "
                                     f"pixels, more than the {self.ctx.max_image_pixels} allowed (--max-image-pixels)")
        # the sampled frames and the settings make the pixel values; a uuid stands for the whole clip, so its
        # hash also holds how many frames were taken from it
        mm_hash = (hash_user_id(str(uid), {**self.video_params, "max_frames": max_frames}) if uid
                   else hash_video(frames, self.video_params))
        return MediaItem(tokens, grid, mm_hash, "video",
                         pixel_values=video_pixels(frames, self.video) if pixels else None)
