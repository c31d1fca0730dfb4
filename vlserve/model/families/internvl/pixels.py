"""InternVL pixel preprocessing: what transformers' processors give, value for value.

Pictures follow `GotOcr2ImageProcessorPil` with `crop_to_patches` (InternVLProcessor's default): the picture is
resized (PIL, the checkpoint's `resample`) to its canvas of cols x rows tiles (tiles.py), cut row by row, and a
thumbnail (the whole picture resized to S x S) follows when there are several tiles; then rescale (float64, then
float32) and normalize (float32). Without tiling the picture is one S x S tile.

Video frames follow `InternVLVideoProcessor` (torchvision in transformers: vlserve.media.pixels.torch_resize):
each frame resized to S x S, rescale and normalize fused.

Settings come from preprocessor_config.json (pictures) and video_preprocessor_config.json (videos; the picture
file when there is none), HF's class defaults for what they leave out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

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
from vlserve.model.families.internvl.tiles import canvas


@dataclass(frozen=True)
class PixelSettings:
    tile: int  # S: the side of every tile and frame
    resample: int = BICUBIC
    rescale: float | None = 1 / 255  # None: no rescale
    mean: tuple[float, float, float] | None = OPENAI_CLIP_MEAN  # None: no normalize
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    min_tiles: int = 1
    max_tiles: int = 12  # 1: no tiling (one S x S tile)

    def hash_params(self) -> dict:
        """What changes the pixel values (part of an item's content hash)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def load_settings(folder: str | Path, kind: str) -> PixelSettings:
    """The checkpoint's picture (`kind="image"`) or video settings, found where transformers looks."""
    raw = processor_settings(folder, kind)
    try:
        size = raw.get("size") or {"height": 384, "width": 384}  # GotOcr2's and InternVL's video defaults
        side = (size, size) if isinstance(size, int) else (int(size["height"]), int(size["width"]))
        if side[0] != side[1] or side[0] <= 0:
            raise ValueError(f"size {size!r} is not a square (height, width)")
        if raw.get("do_resize") is False or raw.get("do_center_crop"):
            raise ValueError("do_resize false or a centre crop: not InternVL's pipeline")
        resample = int(raw.get("resample", BICUBIC))
        if resample not in TORCH_MODES:
            raise ValueError(f"resample {resample} (only nearest 0, bilinear 2 and bicubic 3 are served)")
        # InternVLProcessor asks for tiles whatever the file says (its images_kwargs: crop_to_patches=True)
        tiling = kind == "image"
        settings = PixelSettings(
            tile=side[0], resample=resample,
            rescale=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
            mean=channel_values(raw.get("image_mean", OPENAI_CLIP_MEAN)) if raw.get("do_normalize", True) else None,
            std=channel_values(raw.get("image_std", OPENAI_CLIP_STD)),
            min_tiles=int(raw.get("min_patches", 1)) if tiling else 1,
            max_tiles=int(raw.get("max_patches", 12)) if tiling else 1)
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{folder}: unreadable {kind} processor settings ({type(e).__name__}: {e})") from e
    if settings.mean is not None and min(settings.std) == 0 or not 1 <= settings.min_tiles <= settings.max_tiles:
        raise ModelLoadError(f"{folder}: {kind} processor settings need a non-zero image_std and "
                             f"1 <= min_patches <= max_patches")
    return settings


def picture_tiles(img: Image.Image, s: PixelSettings) -> np.ndarray:
    """uint8 [tiles, S, S, 3]: the canvas's tiles row by row, then the thumbnail when there are several."""
    rgb = np.asarray(img)  # [H, W, 3]
    size = (s.tile, s.tile)
    if s.max_tiles <= 1:
        return pil_resize(rgb, size, s.resample)[None]
    cols, rows = canvas(rgb.shape[0], rgb.shape[1], s.tile, s.min_tiles, s.max_tiles)
    board = pil_resize(rgb, (rows * s.tile, cols * s.tile), s.resample)
    t = s.tile
    tiles = [board[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
    if len(tiles) > 1:
        tiles.append(pil_resize(rgb, size, s.resample))
    return np.stack(tiles)


def picture_pixels(img: Image.Image, s: PixelSettings) -> torch.Tensor:
    """A picture's pixel values: float32 [tiles, 3 * S * S]."""
    return rescale_normalize(picture_tiles(img, s), s.rescale, s.mean, s.std)


def frame_pixels(frames: list[np.ndarray], s: PixelSettings) -> torch.Tensor:
    """uint8 [T, H, W, 3] frames -> float32 [T, 3 * S * S], frame by frame (one full-size copy at a time)."""
    out = []
    for frame in frames:
        x = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous()[None]
        out.append(torch_resize(x, (s.tile, s.tile), s.resample))
    return normalize_frames(torch.cat(out), s.rescale, s.mean, s.std)
