"""Pictures from any source, decoded under bounds checked from the header, as RGB: what every family shares.

How a picture is then resized, normalized and cut into patches is each model family's own rule, kept in its
folder (`vlserve/model/families/<family>/`); only the CLIP normalization constants several of them use live here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

from vlserve.core.config import DEFAULT_MAX_PIXELS_DECODED
from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.media.data_url import decode_data_url, is_data_url

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

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
