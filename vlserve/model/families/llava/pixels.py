"""LLaVA pixel preprocessing: what transformers' processors give, value for value.

Pictures (`anyres_pixels`) follow `LlavaOnevisionImageProcessorPil` / `LlavaNextImageProcessorPil`: the picture is
resized (keeping its aspect, PIL, the checkpoint's `resample`) to fit the best of `image_grid_pinpoints`, padded
with black to it (centred), cut into S x S tiles row by row; the base tile (the whole picture resized to `size`)
comes first. Each tile then goes through the plain pipeline (resize to `size`, centre crop to `crop_size`: no-ops
for tiles already S x S), rescale (float64, then float32) and normalize (float32), exactly in HF's order.

Video frames (`video_pixels`) follow `LlavaOnevisionVideoProcessor` / `LlavaNextVideoVideoProcessor`, which run on
torchvision (not installed here): `tvF.resize` of uint8 frames is `torch.nn.functional.interpolate` with antialias
on the uint8 tensor itself on CPU for bicubic (and for bilinear where the CPU has AVX2; else through float32,
clamped and rounded back to uint8); centre crop; rescale and normalize fused as (x - mean/r) / (std/r) in float32.
That is torch's own resampling, which differs from PIL's by a few levels of 255 on some pixels: a frame is not
the same numbers as the same picture sent through the image processor, in HF either.

Settings come from the checkpoint (`load_settings`: processor_config.json's nested entry, then
video_preprocessor_config.json for videos, then preprocessor_config.json), HF's class defaults for what they leave
out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlserve.core.errors import ModelLoadError
from vlserve.media.image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vlserve.media.pixels import (
    BICUBIC,
    TORCH_MODES,
    channel_values,
    normalize_frames,
    pil_resize,
    processor_settings,
    rescale_normalize,
    torch_resize,
)
from vlserve.model.families.llava.anyres import best_resolution

ONEVISION_PINPOINTS = tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))
NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

# HF's class defaults, by (architecture, "image" | "video"): what a checkpoint's settings leave out
_ONEVISION = {"size": {"height": 384, "width": 384}, "do_center_crop": False, "crop_size": None}
_NEXT = {"size": {"shortest_edge": 224}, "do_center_crop": True, "crop_size": {"height": 224, "width": 224}}
DEFAULTS = {
    ("LlavaOnevisionForConditionalGeneration", "image"): {**_ONEVISION, "image_grid_pinpoints": ONEVISION_PINPOINTS},
    ("LlavaOnevisionForConditionalGeneration", "video"): _ONEVISION,
    ("LlavaNextVideoForConditionalGeneration", "image"): {**_NEXT, "image_grid_pinpoints": NEXT_PINPOINTS},
    ("LlavaNextVideoForConditionalGeneration", "video"): _NEXT,
}


@dataclass(frozen=True)
class PixelSettings:
    """One HF image or video processor's settings."""

    size: tuple[int, int] | int  # (height, width), or an int: the shortest edge (aspect kept)
    crop: tuple[int, int] | None  # centre crop (height, width), None: none
    resample: int = BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    pinpoints: tuple[tuple[int, int], ...] = ()  # pictures: image_grid_pinpoints (height, width)
    tile: int = 0  # the side anyres cuts the canvas at (HF: crop_size's height, else size's height or shortest edge)

    @property
    def base_size(self) -> tuple[int, int]:
        """(height, width) the whole picture is resized to for its base tile."""
        return self.size if isinstance(self.size, tuple) else (self.size, self.size)

    @property
    def out_side(self) -> int:
        """Side of every output tile or frame (what the vision tower reads)."""
        if self.crop is not None:
            return self.crop[0]
        return self.size[0] if isinstance(self.size, tuple) else self.size

    def hash_params(self) -> dict:
        """What changes the pixel values (part of an item's content hash)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# ---- settings ---------------------------------------------------------------------------------------------
def load_settings(folder: str | Path, architecture: str, kind: str) -> PixelSettings:
    """The checkpoint's image (`kind="image"`) or video processor settings, found where transformers looks."""
    raw = processor_settings(folder, kind)
    try:
        return settings_from_dict(raw, DEFAULTS[(architecture, kind)])
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{folder}: unreadable {kind} processor settings ({type(e).__name__}: {e})") from e


def _side_pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    return (int(v["height"]), int(v["width"]))


def settings_from_dict(d: dict, defaults: dict) -> PixelSettings:
    """An HF processor dict (preprocessor_config.json) over the class defaults."""
    d = {**defaults, **{k: v for k, v in d.items() if v is not None}}
    size = d["size"]
    if isinstance(size, int) or "shortest_edge" in size:  # an int: the shortest edge (default_to_square=False)
        if isinstance(size, dict) and size.get("longest_edge"):
            raise ValueError("size with longest_edge is not a LLaVA setting")
        size = int(size if isinstance(size, int) else size["shortest_edge"])
    else:
        size = _side_pair(size)
    crop_size = _side_pair(d["crop_size"]) if d.get("crop_size") else None
    crop = crop_size if d.get("do_center_crop") else None
    resample = int(d.get("resample", BICUBIC))
    if resample not in TORCH_MODES:
        raise ValueError(f"resample {resample} (only nearest 0, bilinear 2 and bicubic 3 are served)")
    s = PixelSettings(size=size, crop=crop, resample=resample, do_resize=bool(d.get("do_resize", True)),
                      do_rescale=bool(d.get("do_rescale", True)),
                      rescale_factor=float(d.get("rescale_factor", 1 / 255)),
                      do_normalize=bool(d.get("do_normalize", True)),
                      mean=channel_values(d.get("image_mean", OPENAI_CLIP_MEAN)),
                      std=channel_values(d.get("image_std", OPENAI_CLIP_STD)),
                      pinpoints=tuple((int(h), int(w)) for h, w in d.get("image_grid_pinpoints") or ()),
                      tile=crop_size[0] if crop_size else size[0] if isinstance(size, tuple) else size)
    if not s.do_resize:
        raise ValueError("do_resize false: tiles and frames of any size are not served")
    if s.crop is not None:
        if s.crop[0] != s.crop[1]:
            raise ValueError(f"crop_size {s.crop} is not square")
        low = min(s.size) if isinstance(s.size, tuple) else s.size
        if low < max(s.crop):  # the crop would pad: HF's image and video processors pad differently
            raise ValueError(f"crop_size {s.crop} is larger than the resized size {s.size}")
    elif not isinstance(s.size, tuple) or s.size[0] != s.size[1]:
        raise ValueError(f"size {s.size} without a centre crop does not make square tiles")
    if any(h <= 0 or w <= 0 for h, w in s.pinpoints) or min(s.std) == 0:
        raise ValueError("grid pinpoints must be positive and image_std non-zero")
    return s


# ---- sizes (known before any pixel is touched) -------------------------------------------------------------
def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The size a picture is resized to before padding to `target` (HF's `get_patch_output_size`)."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def resized_size(height: int, width: int, s: PixelSettings) -> tuple[int, int]:
    """The plain pipeline's resize (before the centre crop): `size`, or its shortest edge keeping the aspect."""
    if isinstance(s.size, tuple):
        return s.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(s.size * long / short)
    return (new_long, s.size) if width <= height else (s.size, new_long)


def canvas_size(height: int, width: int, s: PixelSettings) -> tuple[int, int]:
    """The padded anyres canvas a picture is resized into (its best pinpoint)."""
    return best_resolution(height, width, s.pinpoints)


def frame_size(height: int, width: int, s: PixelSettings) -> tuple[int, int]:
    """A video frame's size after the resize (before the centre crop)."""
    return resized_size(height, width, s)


# ---- pictures ------------------------------------------------------------------------------------------------
def _finish_tile(tile: np.ndarray, s: PixelSettings) -> np.ndarray:
    """HF's per-tile pipeline before rescaling: resize to `size`, centre crop (numpy's arithmetic)."""
    tile = pil_resize(np.ascontiguousarray(tile), resized_size(*tile.shape[:2], s), s.resample)
    if s.crop is not None:
        (h, w), (ch, cw) = tile.shape[:2], s.crop
        top, left = (h - ch) // 2, (w - cw) // 2
        tile = tile[top:top + ch, left:left + cw]
    return tile


def anyres_tiles(img: Image.Image, s: PixelSettings) -> np.ndarray:
    """uint8 [1 + rows * cols, S', S', 3]: the base tile, then the anyres tiles row by row (S' = `out_side`)."""
    rgb = np.asarray(img)  # [H, W, 3]
    height, width = rgb.shape[:2]
    bh, bw = canvas_size(height, width, s)
    nh, nw = patch_output_size(height, width, (bh, bw))
    resized = pil_resize(rgb, (nh, nw), s.resample)
    canvas = np.zeros((bh, bw, 3), dtype=np.uint8)  # black padding, centred (the odd pixel after)
    top, left = (bh - nh) // 2, (bw - nw) // 2
    canvas[top:top + nh, left:left + nw] = resized
    t = s.tile
    tiles = [canvas[i:i + t, j:j + t] for i in range(0, bh, t) for j in range(0, bw, t)]
    base = pil_resize(rgb, s.base_size, s.resample)
    return np.stack([_finish_tile(tile, s) for tile in [base, *tiles]])


def normalize_tiles(tiles: np.ndarray, s: PixelSettings) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3 * H * W] (C, H, W order), as the PIL backend computes."""
    return rescale_normalize(tiles, s.rescale_factor if s.do_rescale else None,
                             s.mean if s.do_normalize else None, s.std)


def anyres_pixels(img: Image.Image, s: PixelSettings) -> torch.Tensor:
    """A picture's pixel values: float32 [num_tiles, 3 * S * S], the base tile first."""
    return normalize_tiles(anyres_tiles(img, s), s)


# ---- video frames --------------------------------------------------------------------------------------------
def video_pixels(frames: np.ndarray | list[np.ndarray], s: PixelSettings) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3 * S * S]: torchvision's resize, centre crop, fused rescale+normalize.
    Frame by frame (the same numbers as HF's batched resize), so only one full-size frame is copied at a time."""
    out = []
    for frame in frames:
        x = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous()[None]  # [1, 3, H, W]
        x = torch_resize(x, resized_size(x.shape[2], x.shape[3], s), s.resample)
        if s.crop is not None:
            (h, w), (ch, cw) = x.shape[-2:], s.crop
            top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
            x = x[:, :, top:top + ch, left:left + cw]
        out.append(x)
    return normalize_frames(torch.cat(out), s.rescale_factor if s.do_rescale else None,
                            s.mean if s.do_normalize else None, s.std)
