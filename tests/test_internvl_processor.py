"""The InternVL request path (vlserve.model.families.internvl: tiles, pixels, processor, checks, config): tiles and
pixel values equal to transformers' `GotOcr2ImageProcessorPil` with `crop_to_patches` (InternVLProcessor's
default), expanded ids equal to transformers' `InternVLProcessor`, `layout` equal to `process` less the pixels,
mm_processor_kwargs, bounds, precomputed embeddings, prompts given as token ids, the engine's item check and the
config's refusals. The tiny checkpoint's tiles are 56 px (4 embedding rows each, at most 6 tiles and a
thumbnail); one picture at InternVL3's own size (448 px, 12 tiles)."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from transformers import AutoTokenizer
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
    GotOcr2ImageProcessorPil,
    get_optimal_tiled_canvas,
)

from tests.hf_reference import internvl_processor
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.model.families.internvl import tiles
from vlserve.model.families.internvl.checks import check_item
from vlserve.model.families.internvl.config import ARCHITECTURE, parse_internvl_config
from vlserve.model.families.internvl.pixels import PixelSettings, load_settings, picture_pixels
from vlserve.model.families.internvl.processor import InternVLProcessor
from vlserve.model.families.processor import ProcessorContext, PromptMedia
from vlserve.model.hf_config import load_model_config

ARCH = "internvl3"
S, ROWS = 56, 4  # the tiny checkpoint's tile side and embedding rows per tile
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def rng_image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def rng_frames(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    folder = tiny_ckpt(ARCH)
    return folder, load_model_config(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(tiny):
    """transformers' InternVLProcessor over the checkpoint (PIL image processor; vlserve's frames for videos)."""
    folder, _, tokenizer = tiny
    return internvl_processor(folder, tokenizer)


def make_processor(tiny, *, limit=100_000, max_pixels=64_000_000, frames=32, embeds=False,
                   cache_bytes=0) -> InternVLProcessor:
    folder, cfg, tokenizer = tiny
    ctx = ProcessorContext(cfg, folder, tokenizer, torch.float32, 8192,
                           (f"max_num_encoder_input_tokens={limit}", limit), max_pixels, frames, embeds, 30.0,
                           20 * 2**20, 200 * 2**20, cache_bytes)
    return InternVLProcessor(ctx)


def prompt(proc, text, images=(), videos=(), kwargs=None, ids=None) -> PromptMedia:
    """A text prompt, or (`ids` given) a prompt sent as token ids."""
    tok = proc.ctx.tokenizer
    media = {"image": [(m, None) for m in images], "video": [(v, None) for v in videos]}
    return PromptMedia(text=None if ids is not None else text, token_ids=ids if ids is not None else tok.encode(text),
                       media=media, mm_kwargs=kwargs or {}, from_token_ids=ids is not None, tokenize=tok.encode)


# ---- tiles and pixels ---------------------------------------------------------------------------------------
# one tile, several tiles with a thumbnail, tall, wide, the most tiles (3 x 2 and 1 x 6), tiny, odd sizes
SIZES = [(30, 30), (1, 1), (56, 56), (100, 100), (200, 60), (60, 200), (200, 300), (600, 100), (300, 280),
         (57, 113), (13, 170), (170, 13), (99, 101), (112, 168)]


def test_picture_pixels_equal_transformers(tiny):
    folder = tiny[0]
    ref = GotOcr2ImageProcessorPil.from_pretrained(folder)
    ours = load_settings(folder, "image")
    assert (ours.tile, ours.min_tiles, ours.max_tiles) == (S, 1, 6)
    seen = set()
    for k, (h, w) in enumerate(SIZES):
        img = rng_image(h, w, seed=k)
        for max_patches in (None, 1, 2):
            s = ours if max_patches is None else dataclasses.replace(ours, max_tiles=max_patches)
            extra = {} if max_patches is None else {"max_patches": max_patches}
            want = ref(img, crop_to_patches=True, return_tensors="np", **extra)["pixel_values"]
            got = picture_pixels(img, s)
            assert got.dtype == torch.float32 and got.shape == (want.shape[0], 3 * S * S), (h, w, max_patches)
            np.testing.assert_allclose(got.view(-1, 3, S, S).numpy(), want, atol=1e-6, rtol=0,
                                       err_msg=f"{h}x{w} max_patches={max_patches}")
            seen.add(want.shape[0])
    assert {1, 3, 4, 5, 7} <= seen, f"the sizes were meant to take every kind of tiling: {seen}"


def test_picture_pixels_equal_transformers_at_internvl3_size():
    """InternVL3's own processor: 448 px tiles, up to 12, ImageNet's mean and std."""
    ref = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, max_patches=12, **IMAGENET)
    ours = PixelSettings(tile=448, mean=tuple(IMAGENET["image_mean"]), std=tuple(IMAGENET["image_std"]))
    img = rng_image(600, 900, seed=3)
    want = ref(img, crop_to_patches=True, return_tensors="np")["pixel_values"]
    assert want.shape[0] == 7  # 3 x 2 and a thumbnail
    np.testing.assert_allclose(picture_pixels(img, ours).view(-1, 3, 448, 448).numpy(), want, atol=1e-6, rtol=0)


def test_tile_counts_and_canvas_equal_transformers(tiny):
    ref = GotOcr2ImageProcessorPil.from_pretrained(tiny[0])
    sides = range(1, 701, 37)
    # 112x126: 2 x 2 and 3 x 3 tie on aspect, its area exactly half 3 x 3 tiles' (the tie keeps 2 x 2)
    sizes = [(h, w) for h in sides for w in sides] + [(112, 126), (126, 112), (112, 112), (56, 112)]
    for mn, mx in [(1, 6), (1, 12), (1, 2), (1, 1), (2, 6), (3, 12), (4, 4)]:
        for h, w in sizes:
            assert tiles.canvas(h, w, S, mn, mx) == get_optimal_tiled_canvas((h, w), (S, S), mn, mx), (h, w, mn, mx)
    assert tiles.canvas(112, 126, S, 1, 12) == (2, 2)
    rng = np.random.default_rng(0)
    sizes += [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(200)]
    for max_patches in (6, 1, 2, 12, 64):
        for h, w in sizes:
            want = ref.get_number_of_image_patches(h, w, {"crop_to_patches": True, "max_patches": max_patches})
            assert tiles.num_tiles(h, w, S, 1, max_patches) == want, (h, w, max_patches)


# ---- the processor against transformers' ---------------------------------------------------------------------
CASES = {
    "picture": ("<IMG_CONTEXT>\nWhat is this?", [(100, 150)], []),
    "two pictures": ("Picture 1: <IMG_CONTEXT>\nPicture 2: <IMG_CONTEXT>\nWhich is brighter?", [(200, 60), (30, 30)],
                     []),
    "picture and video": ("<IMG_CONTEXT>\n<video>\nSame?", [(60, 200)], [(3, 48, 64)]),
}


def case(name: str, seed: int = 0):
    body, sizes, clips = CASES[name]
    return (TURN.format(body), [rng_image(h, w, seed=seed + i) for i, (h, w) in enumerate(sizes)],
            [rng_frames(*c, seed=seed + 50 + i) for i, c in enumerate(clips)])


def check_layout(out, cfg, proc) -> None:
    ids, image = out.prompt_token_ids, cfg.image_token_id
    covered = set()
    for item in out.mm_items:
        assert ids[item.offset:item.end] == [image] * item.num_tokens
        assert ids[item.offset - 1] == proc.start_id and ids[item.end] == proc.end_id, "not exactly one run"
        assert item.num_tokens == item.layout[0] * ROWS
        covered |= set(range(item.offset, item.end))
        check_item(item, cfg)
    assert covered == {i for i, t in enumerate(ids) if t == image}
    assert out.positions.tolist() == [list(range(len(ids)))] and out.position_delta == 0  # one row: plain RoPE


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_equals_transformers_processor(name, tiny, hf):
    proc, cfg = make_processor(tiny), tiny[1]
    text, images, videos = case(name)
    ref = hf(text=[text], images=images or None, videos=videos or None, return_tensors="pt")
    out = proc.process(prompt(proc, text, images, videos))
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    check_layout(out, cfg, proc)
    assert [it.modality for it in out.mm_items] == ["image"] * len(images) + ["video"] * sum(len(v) for v in videos)
    assert all(it.layout == (1, 0, 0) for it in out.mm_items if it.modality == "video")
    got = torch.cat([it.pixel_values for it in out.mm_items])
    np.testing.assert_allclose(got.numpy(), ref["pixel_values"].reshape(len(got), -1).numpy(), atol=1e-6, rtol=0)


def test_layout_equals_process_without_pixels(tiny):
    text, images, videos = case("picture and video", seed=7)
    sources = [png(images[0])]
    for first in ("layout", "process"):  # each order: neither relies on the other's cache
        proc = make_processor(tiny)
        runs = {}
        for how in (first, {"layout": "process", "process": "layout"}[first], "layout"):
            runs.setdefault(how, []).append(getattr(proc, how)(prompt(proc, text, sources, videos)))
        full = runs["process"][0]
        for lay in runs["layout"]:  # the second is a cache hit for the picture
            assert lay.prompt_token_ids == full.prompt_token_ids
            assert torch.equal(lay.positions, full.positions)
            assert [(it.offset, it.num_tokens, it.layout, it.mm_hash, it.modality) for it in lay.mm_items] == \
                [(it.offset, it.num_tokens, it.layout, it.mm_hash, it.modality) for it in full.mm_items]
            assert all(it.pixel_values is None for it in lay.mm_items)
        assert all(it.pixel_values is not None for it in full.mm_items)


# ---- mm_processor_kwargs --------------------------------------------------------------------------------------
def test_max_patches(tiny, hf):
    """Tiles, ids (transformers' with the same `max_patches`) and hashes per setting; the same picture sent as bytes
    again, from the caches of processed items and layouts, keeps each setting's own."""
    proc = make_processor(tiny, cache_bytes=2**24)
    text = TURN.format("<IMG_CONTEXT>\nWhat is this?")
    img = rng_image(200, 300, seed=1)  # 3 x 2 tiles and a thumbnail by default
    data = png(img)
    items = {}
    for _ in range(2):
        for max_patches in (None, 1, 2, 12):
            kwargs = {} if max_patches is None else {"max_patches": max_patches}
            ref = hf(text=[text], images=[img], return_tensors="pt", **kwargs)
            for how in ("process", "layout"):
                out = getattr(proc, how)(prompt(proc, text, [data], kwargs=kwargs))
                assert out.prompt_token_ids == ref["input_ids"][0].tolist(), (how, max_patches)
                (item,) = out.mm_items
                assert (item.layout, item.mm_hash) == items.setdefault(max_patches, (item.layout, item.mm_hash))
                if how == "process":
                    np.testing.assert_allclose(item.pixel_values.numpy(), ref["pixel_values"].reshape(
                        item.layout[0], -1).numpy(), atol=1e-6, rtol=0)
    assert {k: grid[0] for k, (grid, _) in items.items()} == {None: 7, 1: 1, 2: 3, 12: 7}
    assert len({h for _, h in items.values()}) == 4, "max_patches changes the pixels: and so the hash"
    for bad in (0, 65, -1, "3", True, 2.0):
        with pytest.raises(InvalidInputError, match="max_patches"):
            proc.process(prompt(proc, text, [img], kwargs={"max_patches": bad}))


def test_a_checkpoint_whose_min_patches_is_above_one(tiny, tmp_path):
    """min_patches 3: pictures take at least 3 tiles, videos one tile a frame (they never tile), and a request's
    max_patches below it gets one tile, as transformers gives (no arrangement fits)."""
    import shutil

    folder = tmp_path / "min3"
    shutil.copytree(tiny[0], folder)
    (folder / "video_preprocessor_config.json").unlink()  # videos fall back to the picture file, as HF's do
    conf = json.loads((folder / "preprocessor_config.json").read_text()) | {"min_patches": 3}
    (folder / "preprocessor_config.json").write_text(json.dumps(conf))
    assert (load_settings(folder, "image").min_tiles, load_settings(folder, "video").max_tiles) == (3, 1)
    hf_images = GotOcr2ImageProcessorPil.from_pretrained(folder)
    proc = make_processor((folder, *tiny[1:]))
    text = TURN.format("<IMG_CONTEXT>\nWhat is this?")
    for kwargs in ({}, {"max_patches": 2}):
        (item,) = proc.process(prompt(proc, text, [rng_image(100, 100)], kwargs=kwargs)).mm_items
        want = hf_images.get_number_of_image_patches(100, 100, {"crop_to_patches": True, **kwargs})
        assert item.layout[0] == want == (1 if kwargs else 5), kwargs


def test_max_frames(tiny):
    proc = make_processor(tiny, frames=8)
    clip = rng_frames(12, 20, 20)
    out = proc.process(prompt(proc, "<video>", videos=[clip]))
    assert len(out.mm_items) == 8  # --max-video-frames, spread evenly
    assert len(proc.process(prompt(proc, "<video>", videos=[clip], kwargs={"max_frames": 3})).mm_items) == 3
    for bad in (9, 0, True, "2"):
        with pytest.raises(InvalidInputError, match="max_frames" if bad != 9 else "--max-video-frames"):
            proc.process(prompt(proc, "<video>", videos=[clip], kwargs={"max_frames": bad}))


def test_placeholder_count_must_match(tiny):
    proc = make_processor(tiny)
    img, clip = rng_image(30, 30), rng_frames(2, 20, 20)
    for text, images, videos, mark in [("<IMG_CONTEXT> and <IMG_CONTEXT>", [img], [], "<IMG_CONTEXT>"),
                                       ("a <video>", [], [], "<video>"),
                                       ("no marks", [], [clip], "<video>"),
                                       ("<IMG_CONTEXT>", [img, img], [], "<IMG_CONTEXT>")]:
        for ids in (None, proc.ctx.tokenizer.encode(text)):
            with pytest.raises(InvalidInputError, match=f"{mark} placeholder"):
                proc.process(prompt(proc, text, images, videos, ids=ids))


# ---- bounds ---------------------------------------------------------------------------------------------------
def test_too_many_tiles_refused_before_decoding(tiny, monkeypatch):
    import vlserve.model.families.internvl.processor as module

    def never(*a, **k):
        raise AssertionError("decoded or resized before the bounds were checked")

    monkeypatch.setattr(module, "picture_pixels", never)
    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    proc = make_processor(tiny, limit=20)  # 200x300: 7 tiles, 28 tokens
    data = png(rng_image(200, 300))
    with pytest.raises(InvalidInputError, match=r"300x200 picture would take 28 embedding tokens, more than the 20 "
                                                r".*max_patches") as e:
        proc.process(prompt(proc, "<IMG_CONTEXT>", [data]))
    assert not isinstance(e.value, MediaTooLargeError) and e.value.http_status == 400
    with pytest.raises(InvalidInputError, match="28 embedding tokens"):
        proc.layout(prompt(proc, "<IMG_CONTEXT>", [data]))


def test_canvas_over_max_image_pixels_refused(tiny, monkeypatch):
    import vlserve.model.families.internvl.processor as module

    monkeypatch.setattr(module, "picture_pixels", lambda *a: (_ for _ in ()).throw(AssertionError("resized")))
    proc = make_processor(tiny, max_pixels=10_000)  # 30x200 decodes to 6000 pixels, its 6 x 1 canvas is 18816
    with pytest.raises(MediaTooLargeError, match=r"resized to 336x56 = 18816 pixels.*--max-image-pixels") as e:
        proc.process(prompt(proc, "<IMG_CONTEXT>", [png(rng_image(30, 200))]))
    assert e.value.http_status == 413
    assert proc.layout(prompt(proc, "<IMG_CONTEXT>", [rng_image(30, 200)], kwargs={"max_patches": 1})).mm_items


# ---- precomputed embeddings -----------------------------------------------------------------------------------
def test_image_embeddings(tiny):
    proc, cfg = make_processor(tiny, embeds=True), tiny[1]
    width = cfg.embedding_width
    embeds = torch.randn(3 * ROWS, width)
    out = proc.process(prompt(proc, "look: <IMG_CONTEXT>", [{"image_embeds": embeds}]))
    (item,) = out.mm_items
    assert (item.layout, item.num_tokens, item.pixel_values) == ((3, 0, 0), 3 * ROWS, None)
    assert torch.equal(item.embeddings, embeds)
    check_layout(out, cfg, proc)
    again = proc.process(prompt(proc, "<IMG_CONTEXT>", [{"image_embeds": embeds[None].to(torch.bfloat16)}]))
    assert again.mm_items[0].layout == (3, 0, 0) and again.mm_items[0].embeddings.dtype == torch.float32
    for bad, match in [(embeds[:-1], "shape"), (torch.randn(3 * ROWS, width + 1), "shape"),
                       (torch.randn(0, width), "shape"), (embeds * float("nan"), "NaN"),
                       (embeds.to(torch.int32), "dtype")]:
        with pytest.raises(InvalidInputError, match=match):
            proc.process(prompt(proc, "<IMG_CONTEXT>", [{"image_embeds": bad}]))
    with pytest.raises(InvalidInputError, match="--enable-mm-embeds"):
        make_processor(tiny).process(prompt(proc, "<IMG_CONTEXT>", [{"image_embeds": embeds}]))
    with pytest.raises(InvalidInputError, match="video embeddings"):
        proc.process(prompt(proc, "<video>", videos=[{"video_embeds": embeds}]))


# ---- prompts given as token ids -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["picture", "two pictures"])
def test_token_id_prompts_equal_text_prompts(name, tiny):
    proc, cfg = make_processor(tiny), tiny[1]
    text, images, videos = case(name, seed=3)
    by_text = proc.process(prompt(proc, text, images, videos))
    by_ids = proc.process(prompt(proc, text, images, videos, ids=proc.ctx.tokenizer.encode(text)))
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids and by_ids.text is None
    assert [(it.offset, it.num_tokens, it.layout, it.mm_hash) for it in by_ids.mm_items] == \
        [(it.offset, it.num_tokens, it.layout, it.mm_hash) for it in by_text.mm_items]
    check_layout(by_ids, cfg, proc)


def test_token_id_prompt_with_a_video(tiny):
    """Frames laid out in ids (each `FrameN: ` tokenized on its own): a chat turn's ids as the text path's."""
    proc, cfg = make_processor(tiny), tiny[1]
    text, images, videos = case("picture and video", seed=4)
    by_text = proc.process(prompt(proc, text, images, videos))
    out = proc.process(prompt(proc, text, images, videos, ids=proc.ctx.tokenizer.encode(text)))
    assert [it.modality for it in out.mm_items] == ["image", "video", "video", "video"]
    assert out.prompt_token_ids == by_text.prompt_token_ids
    assert [(it.offset, it.mm_hash) for it in out.mm_items] == [(it.offset, it.mm_hash) for it in by_text.mm_items]
    check_layout(out, cfg, proc)


# ---- the engine's check ---------------------------------------------------------------------------------------
def test_check_item(tiny):
    proc, cfg = make_processor(tiny), tiny[1]
    text, images, videos = case("picture and video", seed=5)
    picture, frame = proc.process(prompt(proc, text, images, videos)).mm_items[:2]
    check_item(picture, cfg)
    check_item(frame, cfg)
    t, h, w = picture.layout
    for bad in [dataclasses.replace(picture, num_tokens=picture.num_tokens + ROWS),
                dataclasses.replace(picture, layout=(t + 1, h, w)),
                dataclasses.replace(picture, layout=(0, h, w), num_tokens=0),
                dataclasses.replace(picture, pixel_values=picture.pixel_values[:-1]),
                dataclasses.replace(picture, pixel_values=picture.pixel_values.view(t, 3, S, S)),
                dataclasses.replace(picture, pixel_values=picture.pixel_values[:, :-1]),
                dataclasses.replace(frame, layout=(1, 48, 64)),
                dataclasses.replace(frame, layout=(2, 0, 0), num_tokens=2 * ROWS),
                dataclasses.replace(frame, num_tokens=ROWS + 1),
                dataclasses.replace(picture, modality="audio")]:
        with pytest.raises(InvalidInputError):
            check_item(bad, cfg)


# ---- config ---------------------------------------------------------------------------------------------------
def test_config_refusals(tiny, tmp_path):
    raw = json.loads((tiny[0] / "config.json").read_text())
    parsed = parse_internvl_config(raw, tmp_path, ARCHITECTURE)  # the checkpoint's own config parses
    assert dict(parsed.family_settings)["shuffle_factor"] == 2

    def vision(**kw):
        return {"vision_config": {**raw["vision_config"], **kw}}

    for change, match in [({"text_config": {**raw["text_config"], "model_type": "llama"}}, "'llama' language model"),
                          ({"vision_feature_layer": -2}, "vision_feature_layer -2"),
                          ({"vision_feature_select_strategy": "full"}, "vision_feature_layer"),
                          ({"downsample_ratio": 1 / 3}, "downsample_ratio"),  # 4 patches a side, folded by 3
                          ({"downsample_ratio": 0.3}, "downsample_ratio"),  # 1 / 0.3 is no integer
                          ({**vision(image_size=70)}, "downsample_ratio"),  # 5 patches a side, folded by 2
                          ({**vision(image_size=60)}, "image_size"),  # no whole number of patches
                          ]:
        with pytest.raises(ModelLoadError, match=match):
            parse_internvl_config({**raw, **change}, tmp_path, ARCHITECTURE)
