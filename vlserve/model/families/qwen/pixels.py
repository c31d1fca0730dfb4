"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL picture rules: the image processor's settings, `smart_resize` and patches.

Qwen's own, so kept in its family folder (the shared media layer only decodes). `preprocess_image` reproduces
`Qwen2VLImageProcessorPil` (transformers 5.23): RGB conversion with transparency composited on white, PIL bicubic
resize of the uint8 image to `smart_resize` size, rescale + normalize, then patchify into merge-window-major order
with each frame repeated `temporal_patch_size` times. Pixel values match it to ~5e-7 (float32 rounding order only).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.media.image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, to_rgb
from vlserve.media.pixels import channel_values, read_json_object

MAX_ASPECT_RATIO = 200  # smart_resize's bound on long side / short side (transformers')


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Resized sides must be multiples of this (one merge window)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageProcessorConfig":
        """Read an HF `preprocessor_config.json` dict.

        Like transformers, top-level `min_pixels` / `max_pixels` win over `size`
        (`shortest_edge` / `longest_edge`, or the older `min_pixels` / `max_pixels` inside `size`).
        """
        size = d.get("size") or {}
        min_px = size.get("shortest_edge", size.get("min_pixels", cls.min_pixels))
        max_px = size.get("longest_edge", size.get("max_pixels", cls.max_pixels))
        if d.get("min_pixels") is not None:
            min_px = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_px = d["max_pixels"]
        cfg = cls(
            min_pixels=int(min_px),
            max_pixels=int(max_px),
            patch_size=int(d.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(d.get("merge_size", cls.merge_size)),
            image_mean=channel_values(d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=channel_values(d.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
        )
        if min(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) <= 0:
            raise ValueError(f"invalid patch/merge sizes in preprocessor config: {cfg}")
        return cfg

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "ImageProcessorConfig":
        raw = read_json_object(Path(folder) / "preprocessor_config.json")
        if raw is None:
            raise ModelLoadError(f"{folder}: no preprocessor_config.json (the image processor settings)")
        return cls.from_dict(raw)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # float32 [t*h*w, 3 * temporal_patch_size * patch * patch]
    layout: tuple[int, int, int]  # in patches, before merging
    merge_size: int = 2

    @property
    def num_embed_tokens(self) -> int:
        """Number of `<|image_pad|>` tokens this image occupies in the prompt."""
        t, h, w = self.layout
        return t * h * w // self.merge_size**2


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
) -> tuple[int, int]:
    """Pick the (h, w) closest to the input with both sides multiples of `factor` and area in
    [min_pixels, max_pixels] (bit-for-bit the same result as transformers' `smart_resize`)."""
    if height <= 0 or width <= 0:
        raise InvalidInputError(f"image size must be positive, got {width}x{height}")
    if min_pixels > max_pixels:
        raise InvalidInputError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    if max(height, width) / min(height, width) > max_aspect_ratio:
        raise InvalidInputError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds {max_aspect_ratio}"
        )
    h_bar = round(height / factor) * factor  # Python round: banker's rounding, as in transformers
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resolve_pixel_limits(
    cfg: ImageProcessorConfig, min_pixels: int | None = None, max_pixels: int | None = None, cap: int | None = None
) -> tuple[int, int]:
    """The resize bounds: per-request overrides on top of the model's limits, validating user-supplied values.

    `cap` (the server's --max-image-pixels) shrinks the model's own bounds to fit under it, so every picture is
    resized to at most `cap` pixels; only a request that asks for more than the cap itself is refused."""
    for name, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")
        if v is not None and cap is not None and v > cap:
            raise InvalidInputError(f"{name} {v} is above the server's --max-image-pixels ({cap})")
    model_hi = cfg.max_pixels if cap is None else min(cfg.max_pixels, cap)
    model_lo = cfg.min_pixels if cap is None else min(cfg.min_pixels, model_hi)
    lo = model_lo if min_pixels is None else min_pixels
    hi = model_hi if max_pixels is None else max_pixels
    if lo > hi:
        raise InvalidInputError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})")
    return lo, hi


def preprocess_image(
    image: Image.Image,
    cfg: ImageProcessorConfig,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ProcessedImage:
    """Resize, normalize and patchify one image for the Qwen2-VL vision tower."""
    lo, hi = resolve_pixel_limits(cfg, min_pixels, max_pixels)
    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, cfg.factor, lo, hi)
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.array(rgb, dtype=np.uint8))  # [h, w, 3], own writable copy
    return ProcessedImage(_patchify(pixels, cfg), (1, h // cfg.patch_size, w // cfg.patch_size), cfg.merge_size)


def _patchify(pixels: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """uint8 [H, W, C] -> normalized float32 [gh*gw, C*T*p*p] in merge-window-major order.

    Row order is (window_row, window_col, row_in_window, col_in_window); each row is laid out
    (channel, temporal, py, px). Normalization runs on the t=0 slot after the layout copy so the
    whole thing is one strided uint8->float copy, one in-place affine pass and one duplication.
    """
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w, c = pixels.shape
    gh, gw = h // p, w // p
    src = pixels.view(gh // m, m, p, gw // m, m, p, c).permute(0, 3, 1, 4, 6, 2, 5)
    out = torch.empty((gh // m, gw // m, m, m, c, tp, p, p), dtype=torch.float32)
    first = out[:, :, :, :, :, 0]
    first.copy_(src)
    # (x * rescale - mean) / std folded into one multiply-add per channel.
    std = torch.tensor(cfg.image_std, dtype=torch.float64)
    scale = (cfg.rescale_factor / std).to(torch.float32).view(c, 1, 1)
    shift = (torch.tensor(cfg.image_mean, dtype=torch.float64) / std).to(torch.float32).view(c, 1, 1)
    first.mul_(scale).sub_(shift)
    if tp > 1:  # a still image is a clip of `tp` identical frames
        out[:, :, :, :, :, 1:].copy_(first.unsqueeze(5).expand(-1, -1, -1, -1, -1, tp - 1, -1, -1))
    return out.view(gh * gw, c * tp * p * p)
