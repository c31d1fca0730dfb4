"""vlserve.model.families.qwen.pixels (and vlserve.media.image's decoding) against transformers'
Qwen2VLImageProcessorPil and smart_resize."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from vlserve.core.errors import InvalidInputError
from vlserve.media.image import load_image
from vlserve.model.families.qwen.pixels import (
    ImageProcessorConfig,
    preprocess_image,
    smart_resize,
)

DEFAULT_MIN, DEFAULT_MAX = 56 * 56, 28 * 28 * 1280
RNG = np.random.default_rng(1234)


def _noise(h: int, w: int, c: int) -> np.ndarray:
    return RNG.integers(0, 256, (h, w, c), dtype=np.uint8)


def make_image(mode: str, w: int, h: int) -> Image.Image:
    if mode == "RGB":
        return Image.frombytes("RGB", (w, h), _noise(h, w, 3).tobytes())
    if mode == "L":
        return Image.frombytes("L", (w, h), _noise(h, w, 1).tobytes())
    if mode in ("RGBA", "LA", "CMYK"):
        return Image.frombytes(mode, (w, h), _noise(h, w, len(mode)).tobytes())
    if mode in ("P", "P+transparency"):
        img = Image.frombytes("P", (w, h), (_noise(h, w, 1) % 64).tobytes())
        img.putpalette(_noise(1, 64, 3).tobytes())
        if mode == "P+transparency":
            img.info["transparency"] = 3
        return img
    raise AssertionError(mode)


# --------------------------------------------------------------------------------------------
# smart_resize
# --------------------------------------------------------------------------------------------

SIZES = [1, 2, 13, 27, 28, 29, 55, 56, 57, 100, 224, 333, 448, 500, 719, 1000, 1024, 1080, 1920, 4000, 9999]
LIMITS = [(DEFAULT_MIN, DEFAULT_MAX), (3136, 12845056), (100, 28 * 28 * 4), (28 * 28 * 16, 28 * 28 * 16)]


@pytest.mark.parametrize("min_px,max_px", LIMITS)
def test_smart_resize_matches_transformers(min_px: int, max_px: int) -> None:
    for h in SIZES:
        for w in SIZES:
            try:
                expected = hf_smart_resize(h, w, 28, min_px, max_px)
            except ValueError:
                with pytest.raises(InvalidInputError):
                    smart_resize(h, w, 28, min_px, max_px)
                continue
            assert smart_resize(h, w, 28, min_px, max_px) == expected, (h, w)


def test_smart_resize_edges() -> None:
    assert smart_resize(1, 1) == hf_smart_resize(1, 1) == (56, 56)
    assert smart_resize(28, 28) == hf_smart_resize(28, 28)
    assert smart_resize(100_000, 100_000) == hf_smart_resize(100_000, 100_000)
    # Exactly at, just under and just over max_pixels once rounded to 28.
    for side in (28 * 35, 28 * 36 - 1, 28 * 36, 28 * 36 + 1, 28 * 37):
        assert smart_resize(side, side) == hf_smart_resize(side, side)
        assert smart_resize(side, 28 * 32) == hf_smart_resize(side, 28 * 32)
    assert smart_resize(28, 28 * 200) == hf_smart_resize(28, 28 * 200)  # aspect 200 is accepted
    assert smart_resize(3, 600) == hf_smart_resize(3, 600)
    with pytest.raises(InvalidInputError, match="aspect"):
        smart_resize(28, 28 * 200 + 1)
    with pytest.raises(InvalidInputError, match="aspect"):
        smart_resize(201, 1)
    with pytest.raises(InvalidInputError, match="min_pixels"):
        smart_resize(100, 100, min_pixels=5000, max_pixels=4000)
    for h, w in ((0, 10), (10, 0), (-1, 5)):
        with pytest.raises(InvalidInputError):
            smart_resize(h, w)


# --------------------------------------------------------------------------------------------
# preprocess_image
# --------------------------------------------------------------------------------------------


def _reference(img: Image.Image, min_px: int = DEFAULT_MIN, max_px: int = DEFAULT_MAX) -> tuple[torch.Tensor, list]:
    proc = Qwen2VLImageProcessorPil(min_pixels=min_px, max_pixels=max_px)
    out = proc(img, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


def _assert_same(img: Image.Image, min_px: int | None = None, max_px: int | None = None) -> None:
    ref_pv, ref_grid = _reference(img, min_px or DEFAULT_MIN, max_px or DEFAULT_MAX)
    got = preprocess_image(img, ImageProcessorConfig(), min_pixels=min_px, max_pixels=max_px)
    assert list(got.layout) == ref_grid
    assert got.pixel_values.dtype == torch.float32
    assert got.pixel_values.shape == ref_pv.shape
    torch.testing.assert_close(got.pixel_values, ref_pv, atol=1e-5, rtol=0)
    assert got.num_embed_tokens == ref_grid[0] * ref_grid[1] * ref_grid[2] // 4


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "P+transparency", "LA", "CMYK"])
@pytest.mark.parametrize("size", [(1, 1), (28, 28), (57, 31), (320, 240), (700, 1300)])
def test_preprocess_matches_transformers(mode: str, size: tuple[int, int]) -> None:
    _assert_same(make_image(mode, *size))


@pytest.mark.parametrize("min_px,max_px", [(None, 28 * 28 * 64), (28 * 28 * 256, None), (3136, 200_000), (100, 784)])
def test_preprocess_per_request_limits(min_px: int | None, max_px: int | None) -> None:
    _assert_same(make_image("RGB", 500, 375), min_px, max_px)


def test_preprocess_large_image_shape() -> None:
    got = preprocess_image(make_image("RGB", 1024, 1024), ImageProcessorConfig())
    assert got.layout == (1, 70, 70)
    assert got.pixel_values.shape == (4900, 3 * 2 * 14 * 14)
    assert got.num_embed_tokens == 1225


@pytest.mark.parametrize(
    "min_px,max_px", [(0, None), (None, -5), (2.5, None), ("100", None), (True, None), (10_000, 5_000)]
)
def test_preprocess_rejects_bad_limits(min_px: object, max_px: object) -> None:
    with pytest.raises(InvalidInputError):
        preprocess_image(make_image("RGB", 64, 64), ImageProcessorConfig(), min_pixels=min_px, max_pixels=max_px)  # type: ignore[arg-type]


def test_config_from_dict_and_pretrained(tmp_path: Path) -> None:
    assert ImageProcessorConfig.from_dict({}) == ImageProcessorConfig()
    cfg = ImageProcessorConfig.from_dict(
        {"size": {"shortest_edge": 1000, "longest_edge": 2000}, "patch_size": 16, "image_mean": [0.5, 0.5, 0.5]}
    )
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.image_mean) == (1000, 2000, 16, (0.5, 0.5, 0.5))
    d = {"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(d))
    cfg = ImageProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.merge_size, cfg.rescale_factor) == (3136, 12845056, 2, 1 / 255)


# --------------------------------------------------------------------------------------------
# load_image
# --------------------------------------------------------------------------------------------


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_sources(tmp_path: Path) -> None:
    img = make_image("RGB", 40, 30)
    data = _png_bytes(img)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    expected = np.asarray(img)
    for src in (img, str(path), path, data, bytearray(data), url):
        out = load_image(src)
        assert out.mode == "RGB" and out.size == (40, 30)
        np.testing.assert_array_equal(np.asarray(out), expected)


def test_load_image_modes() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red -> white
    assert load_image(_png_bytes(rgba)).getpixel((0, 0)) == (255, 255, 255)
    half = Image.new("RGBA", (4, 4), (0, 0, 0, 128))
    assert load_image(half).getpixel((0, 0)) == (127, 127, 127)
    la = Image.new("LA", (4, 4), (0, 0))
    assert load_image(la).getpixel((0, 0)) == (255, 255, 255)
    pal = Image.new("RGB", (4, 4), (10, 20, 30)).quantize(colors=4)
    pal.info["transparency"] = 0
    assert load_image(pal).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(Image.new("L", (2, 2), 77)).getpixel((0, 0)) == (77, 77, 77)
    assert load_image(Image.new("CMYK", (2, 2), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    # 16-bit grayscale is scaled to 8 bits instead of clipped at 255.
    deep = Image.frombytes("I;16", (3, 1), np.array([0, 32896, 65535], dtype="<u2").tobytes())
    row = np.asarray(load_image(_png_bytes(deep)))[0, :, 0]
    assert row.tolist() == [0, 128, 255]


def test_load_image_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="not a decodable image"):
        load_image(b"definitely not an image")
    with pytest.raises(InvalidInputError, match="base64"):
        load_image("data:image/png;base64,@@@not*base64@@@")
    with pytest.raises(InvalidInputError):
        load_image("data:image/png;base64," + base64.b64encode(b"garbage").decode())
    with pytest.raises(InvalidInputError, match="not found"):
        load_image(str(tmp_path / "missing.png"))
    with pytest.raises(InvalidInputError, match="not found"):
        load_image(tmp_path / ("x" * 5000))
    truncated = _png_bytes(make_image("RGB", 64, 64))[:200]
    with pytest.raises(InvalidInputError):
        load_image(truncated)
    with pytest.raises(InvalidInputError):
        load_image(12345)  # type: ignore[arg-type]


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims a huge size: only a header-first check can reject it cheaply."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb() -> None:
    with pytest.raises(InvalidInputError, match="pixels"):
        load_image(_png_header_only(10_000, 10_000))  # 100 MP > default 64 MP
    with pytest.raises(InvalidInputError):
        load_image(_png_header_only(30_000, 30_000), max_pixels_decoded=10**10)  # PIL's own bomb guard
    small = _png_bytes(Image.new("RGB", (2000, 1000)))
    with pytest.raises(InvalidInputError, match="pixels"):
        load_image(small, max_pixels_decoded=1_000_000)
    assert load_image(small, max_pixels_decoded=2_000_000).size == (2000, 1000)
    with pytest.raises(InvalidInputError, match="pixels"):
        load_image(Image.new("RGB", (2000, 1000)), max_pixels_decoded=1_000_000)
