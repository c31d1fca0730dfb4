"""--max-image-pixels: a cap under the model's max_pixels shrinks the resize target instead of refusing every
picture; only what is over the cap by itself (a decoded picture, a request's own min/max_pixels) is refused."""

from __future__ import annotations

import pytest

from tests.conftest import noise_image
from tests.test_video import clip_frames
from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.engine.config import resolve_config
from vlserve.frontend.input_processor import InputProcessor

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
CAP = 40_000


def processor(ckpt, cap: int | None = None) -> InputProcessor:
    cfg = resolve_config(EngineArgs(model=str(ckpt), dtype="float32"), announce=False)
    return InputProcessor.for_model(cfg, **({} if cap is None else {"max_image_pixels": cap}))


def resized_pixels(proc: InputProcessor, item) -> int:
    _, h, w = item.layout
    return h * w * proc.processor.image_cfg.patch_size**2


def picture(proc: InputProcessor, img, **mm_kwargs):
    return proc.process({"prompt": f"{IMG}hi", "multi_modal_data": {"image": [img]}}, mm_kwargs).mm_items[0]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_a_cap_below_the_models_max_pixels_shrinks_pictures(tiny_ckpt, arch):
    capped, free = processor(tiny_ckpt(arch), CAP), processor(tiny_ckpt(arch))
    assert capped.processor.image_cfg.max_pixels > CAP, "the checkpoint must allow more than the cap for this test"
    # (the decoded size must be within the cap too; 211 x 189 rounds to 224 x 196 = 43,904 pixels unless shrunk)
    for size in ((64, 64), (200, 200), (211, 189), (189, 211)):
        got = picture(capped, noise_image(*size, 1))
        assert resized_pixels(capped, got) <= CAP
        # exactly what the model does when asked for max_pixels=CAP
        want = picture(free, noise_image(*size, 1), max_pixels=CAP)
        assert (got.layout, got.mm_hash) == (want.layout, want.mm_hash)
        assert got.pixel_values.equal(want.pixel_values)
    small = picture(capped, noise_image(40, 40, 2))  # under the cap: as without one
    assert small.layout == picture(free, noise_image(40, 40, 2)).layout


def test_what_is_over_the_cap_by_itself_is_refused(tiny_ckpt):
    proc = processor(tiny_ckpt("qwen2_vl"), CAP)
    with pytest.raises(InvalidInputError, match="max_pixels 50000 is above the server's --max-image-pixels"):
        picture(proc, noise_image(64, 64, 1), max_pixels=50_000)
    with pytest.raises(InvalidInputError, match="min_pixels 45000 is above the server's --max-image-pixels"):
        picture(proc, noise_image(64, 64, 1), min_pixels=45_000)
    with pytest.raises(MediaTooLargeError):  # decoded size over the cap: refused before decoding
        picture(proc, noise_image(250, 170, 1))
    assert resized_pixels(proc, picture(proc, noise_image(64, 64, 1), max_pixels=CAP)) <= CAP


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_a_cap_shrinks_video_frames_too(tiny_ckpt, arch):
    cap = 20_000
    capped, free = processor(tiny_ckpt(arch), cap), processor(tiny_ckpt(arch))
    frames = clip_frames(4, h=154, w=127)  # within the cap as decoded, over it once rounded to the grid
    video = {"prompt": f"{VID}hi", "multi_modal_data": {"video": [frames]}}
    uncapped = free.process(video).mm_items
    assert max(resized_pixels(free, it) for it in uncapped) > cap, "the frames must be larger than the cap"
    items = capped.process(video).mm_items
    assert items and all(resized_pixels(capped, it) <= cap for it in items)


@pytest.mark.parametrize("mode, refused", [("RGB", False), ("L", False), ("P", False), ("I;16", False),
                                           ("F", True), ("I", True)])
def test_the_cap_counts_the_bytes_a_picture_decodes_to(mode, refused):
    """A cap of N pixels allows N x 3 bytes: a float or 32-bit picture of as many pixels decodes to more (a 62 MP
    mode-F TIFF is a 480 KB file and 248 MB decoded), and is refused from its header, before decoding."""
    import io

    from PIL import Image

    from vlserve.media.image import load_image

    buf = io.BytesIO()
    Image.new(mode, (100, 100)).save(buf, format="TIFF")
    if refused:
        with pytest.raises(MediaTooLargeError, match=f"mode {mode}, which decode to 40000 bytes"):
            load_image(buf.getvalue(), max_pixels_decoded=10_000)
    else:
        assert load_image(buf.getvalue(), max_pixels_decoded=10_000).size == (100, 100)
    assert load_image(buf.getvalue(), max_pixels_decoded=20_000).mode == "RGB"  # under the cap: converted


def test_deep_pictures_are_scaled_to_8_bits_in_slices():
    """16-bit and float pictures are scaled to 8 bits a slice of rows at a time: the float64 temporaries stay
    small instead of 16 bytes per pixel of the whole picture."""
    import tracemalloc

    import numpy as np
    from PIL import Image

    from vlserve.media.image import to_rgb

    rng = np.random.default_rng(0)
    deep = Image.fromarray(rng.integers(0, 65535, (2000, 1500), dtype=np.uint16))  # 3 MP, I;16
    tracemalloc.start()
    rgb = to_rgb(deep)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 3e6 * 5, f"{peak / 1e6:.0f} MB for a 3 MP picture"  # was ~26 bytes per pixel
    expected = np.clip(np.rint(np.asarray(deep).astype(np.float64) * (255 / 65535)), 0, 255).astype(np.uint8)
    assert np.array_equal(np.asarray(rgb)[..., 0], expected)
