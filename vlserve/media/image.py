"""Image decoding and Qwen2-VL / Qwen2.5-VL image preprocessing.

`preprocess_image` reproduces `Qwen2VLImageProcessorPil` (transformers 5.23): RGB conversion with
transparency composited on white, PIL bicubic resize of the uint8 image to `smart_resize` size,
rescale + normalize, then patchify into merge-window-major order with each frame repeated
`temporal_patch_size` times. Pixel values match it to ~5e-7 (float32 rounding order only).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

from vlserve.core.config import DEFAULT_MAX_PIXELS_DECODED
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.media.data_url import decode_data_url, is_data_url

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200

ImageSource = Union[Image.Image, str, os.PathLike, bytes, bytearray, memoryview]



# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageBounds:
    """What a picture may be, all checked from its header (Pillow reads the size without decoding a pixel), before
    it is decoded, resized or tiled. `max_pixels` is the server's (--max-image-pixels: pixels as decoded, and the
    bytes they decode to); `max_side` and `max_aspect_ratio` are what the model family's processing refuses later
    in any case (each family declares its own: `MultiModalProcessor.max_image_side` / `max_image_aspect_ratio`),
    so a picture it would refuse costs no decode. All three are the same whichever way the picture is turned."""

    max_pixels: int = DEFAULT_MAX_PIXELS_DECODED
    max_side: int | None = None  # each side, in pixels
    max_aspect_ratio: float | None = None  # the long side over the short one

    def check(self, width: int, height: int, mode: str = "RGB") -> None:
        _check_decoded_size(width, height, self.max_pixels, mode)
        self.check_shape(width, height)

    def check_shape(self, width: int, height: int, what: str = "image") -> None:
        """Each side and the aspect ratio (a size already known to be positive)."""
        if self.max_side is not None and max(width, height) > self.max_side:
            raise MediaTooLargeError(f"{what} is {width}x{height} pixels; this model takes at most {self.max_side} "
                                     "pixels a side")
        if self.max_aspect_ratio is not None and max(width, height) / min(width, height) > self.max_aspect_ratio:
            raise InvalidInputError(f"{what} is {width}x{height} pixels, an aspect ratio of "
                                    f"{max(width, height) / min(width, height):.1f}; this model takes at most "
                                    f"{self.max_aspect_ratio:g} (long side / short side)")


# A family's check of a picture's size (width, height) before decoding: what its resize or tiling would make of
# it (token count, resized size), raising InvalidInputError for what it would refuse.
SizeCheck = Callable[[int, int], None]


def load_image(source: ImageSource, max_pixels_decoded: int | ImageBounds = DEFAULT_MAX_PIXELS_DECODED,
               check: SizeCheck | None = None) -> Image.Image:
    """Decode `source` into a fully loaded RGB PIL image.

    `source` is a PIL image, a local path (str / PathLike, optionally `file://`), raw encoded bytes,
    or a `data:image/...;base64,...` URL. Paths are opened as given: callers exposing this to
    untrusted users must decide whether local files are allowed at all.

    `max_pixels_decoded` (the pixel cap, or a model family's `ImageBounds`: the cap and its shape bounds) and then
    `check` are applied to the size the header states, before any pixel is decoded. The header's size is as
    stored: EXIF may turn the picture a quarter, so `check` refuses it here only if it would refuse it either way
    round (the caller checks the decoded picture again).
    """
    bounds = (max_pixels_decoded if isinstance(max_pixels_decoded, ImageBounds)
              else ImageBounds(max_pixels=max_pixels_decoded))
    if isinstance(source, Image.Image):
        check_header_size(source.width, source.height, source.mode, bounds, check)
        return to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(source)), bounds, check, what="image bytes")
    if isinstance(source, os.PathLike):
        return _open_path(Path(source), bounds, check)
    if isinstance(source, str):
        if is_data_url(source):
            return _decode(io.BytesIO(decode_data_url(source, kind="image")), bounds, check, "data URL")
        if source.startswith(("http://", "https://")):
            raise InvalidInputError("remote image URLs must be fetched before load_image")
        return _open_path(Path(source.removeprefix("file://")), bounds, check)
    raise InvalidInputError(f"unsupported image source type {type(source).__name__}")


def check_header_size(width: int, height: int, mode: str, bounds: ImageBounds, check: SizeCheck | None) -> None:
    """`bounds`, then the family's `check` (refusing only what it refuses both ways round: see `load_image`)."""
    bounds.check(width, height, mode)
    if check is None:
        return
    try:
        check(width, height)
    except InvalidInputError as first:
        if width == height:
            raise
        try:
            check(height, width)
        except InvalidInputError:
            raise first from None


def _open_path(path: Path, bounds: ImageBounds, check: SizeCheck | None) -> Image.Image:
    try:
        found = path.is_file()
    except (OSError, ValueError):  # e.g. name too long: treat like any other missing file
        found = False
    if not found:
        raise InvalidInputError(f"image file not found: {str(path)[:256]}")
    try:
        with open(path, "rb") as f:
            return _decode(f, bounds, check, what=f"image file {path.name!r}")
    except OSError as e:
        raise InvalidInputError(f"cannot read image file {path.name!r}: {e}") from None


# Pillow's own guard against decompression bombs: DecompressionBombError (or its warning, where warnings are made
# errors) for a picture over Image.MAX_IMAGE_PIXELS (x 2 for the error), raised in open() before the size reaches
# our check, or in load() for a frame or tile. Its text never reaches a client: `_refused_by_pillow` says it again.
_PILLOW_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)
_PILLOW_PIXELS = re.compile(r"\((\d+) pixels\)")  # "Image size (10000000000 pixels) exceeds limit of ..."


def _decode(fp: Any, bounds: ImageBounds, check: SizeCheck | None, what: str) -> Image.Image:
    try:
        img = Image.open(fp)  # reads only the header: size is known before any pixel is decoded
    except _PILLOW_BOMB as e:
        raise _refused_by_pillow(e, bounds.max_pixels) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise InvalidInputError(f"{what} is not a decodable image ({e.__class__.__name__})") from None
    check_header_size(img.width, img.height, img.mode, bounds, check)
    try:
        img.load()
        return to_rgb(_apply_exif_orientation(img))
    except _PILLOW_BOMB as e:
        raise _refused_by_pillow(e, bounds.max_pixels, "a frame or tile of the ") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated / corrupt payload
        raise InvalidInputError(f"{what} could not be decoded: {e}") from None


def _refused_by_pillow(error: Exception, max_pixels: int, part: str = "") -> MediaTooLargeError:
    """Pillow's decompression-bomb refusal in our words: the picture's pixels (as its header states them, from
    Pillow's message) and the cap that refuses it, --max-image-pixels. Pillow's limit is the larger one unless the
    cap was raised above it: then the picture may be within the cap, and the message says Pillow's limit refused
    it."""
    m = _PILLOW_PIXELS.search(str(error))
    limit = (Image.MAX_IMAGE_PIXELS or 0) * (2 if isinstance(error, Image.DecompressionBombError) else 1)
    pixels = int(m.group(1)) if m else None
    size = f"{pixels} pixels" if pixels is not None else f"more than {limit} pixels"
    if (pixels if pixels is not None else limit) > max_pixels:
        return MediaTooLargeError(f"{part}image is {size}, more than the {max_pixels} allowed (--max-image-pixels)")
    return MediaTooLargeError(f"{part}image is {size}: within --max-image-pixels ({max_pixels}) but over the {limit} "
                              "pixels the image library (Pillow) decodes at most, its guard against decompression "
                              "bombs")


def _apply_exif_orientation(img: Image.Image) -> Image.Image:
    # Phones store rotation in EXIF; honour it as transformers' own load_image does. A malformed
    # EXIF block is not worth rejecting the request over, so fall back to the stored orientation.
    # In place: a picture without a rotation is not copied.
    with contextlib.suppress(Exception):  # Pillow raises assorted types on bad EXIF
        ImageOps.exif_transpose(img, in_place=True)
    return img


def _bytes_per_pixel(mode: str) -> int:
    try:
        m = ImageMode.getmode(mode)
    except KeyError:
        return 4  # an unknown mode: assume the widest common one
    return len(m.bands) * np.dtype(m.typestr).itemsize


def _check_decoded_size(width: int, height: int, max_pixels_decoded: int, mode: str = "RGB") -> None:
    """Refused before decoding when the pixels, or the bytes they decode to, exceed the cap. A cap of N pixels
    allows N x 3 bytes (RGB): a float (mode F) or 16-bit picture of as many pixels decodes to more and is
    refused, rather than costing several times the memory the operator sized for."""
    if width <= 0 or height <= 0:
        raise InvalidInputError(f"image has empty size {width}x{height}")
    if width * height > max_pixels_decoded:
        raise MediaTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, more than the {max_pixels_decoded} allowed "
            "(--max-image-pixels)")
    decoded = width * height * _bytes_per_pixel(mode)
    if decoded > max_pixels_decoded * 3:
        raise MediaTooLargeError(
            f"image is {width}x{height} pixels of mode {mode}, which decode to {decoded} bytes, more than the "
            f"{max_pixels_decoded * 3} allowed ({max_pixels_decoded} pixels x 3 bytes, --max-image-pixels)")


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB.

    Transparency (alpha band, or a `transparency` entry for P/L/RGB) is composited on white, exactly as
    transformers' `convert_to_rgb` does. Deep modes (I;16, I, F) are scaled to 8 bits instead of
    being clipped at 255 as a plain `convert("RGB")` would.
    """
    if img.mode == "RGB" and img.info.get("transparency") is None:
        return img
    if img.mode.startswith("I;16") or img.mode in ("I", "F"):
        img = _deep_to_l(img)
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")  # L, P, CMYK, YCbCr, LAB, HSV, 1 ...


_DEEP_ROWS_PIXELS = 1 << 18  # scaled in slices of about this many pixels: float64 temporaries stay ~2 MB


def _deep_to_l(img: Image.Image) -> Image.Image:
    arr = np.asarray(img)
    top = arr.max() if arr.size else 0
    if img.mode == "F":
        peak = 1.0 if arr.size and top <= 1.0 else 255.0
    elif img.mode == "I" and (arr.size == 0 or top <= 255):
        peak = 255.0  # 8-bit data stored in a 32-bit container
    else:
        peak = 65535.0
    out = np.empty(arr.shape, dtype=np.uint8)
    rows = max(1, _DEEP_ROWS_PIXELS // max(1, arr.shape[1] if arr.ndim > 1 else 1))
    for r in range(0, arr.shape[0], rows):
        out[r:r + rows] = np.clip(np.rint(arr[r:r + rows].astype(np.float64) * (255.0 / peak)), 0, 255)
    return Image.fromarray(out, mode="L")


# ---------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------


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
            image_mean=_three_floats(d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=_three_floats(d.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
        )
        if min(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) <= 0:
            raise ValueError(f"invalid patch/merge sizes in preprocessor config: {cfg}")
        return cfg

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "ImageProcessorConfig":
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no preprocessor_config.json (the image processor settings)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
        return cls.from_dict(raw)


def _three_floats(v: Any) -> tuple[float, float, float]:
    vals = [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * 3
    if len(vals) != 3:
        raise ValueError(f"expected 3 channel values, got {v!r}")
    return (vals[0], vals[1], vals[2])


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # float32 [t*h*w, 3 * temporal_patch_size * patch * patch]
    grid_thw: tuple[int, int, int]  # in patches, before merging
    merge_size: int = 2

    @property
    def num_embed_tokens(self) -> int:
        """Number of `<|image_pad|>` tokens this image occupies in the prompt."""
        t, h, w = self.grid_thw
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
