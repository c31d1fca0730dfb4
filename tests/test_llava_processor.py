"""The LLaVA request path (vlserve.model.families.llava.processor / pixels): pictures' anyres tiles equal to
transformers' `LlavaOnevisionImageProcessorPil` / `LlavaNextImageProcessorPil`, placeholder expansion equal to
`LlavaOnevisionProcessor` / `LlavaNextVideoProcessor`, video frames as their torchvision video processors make
them, frame sampling, bounds, hashes and precomputed embeddings. Small tiles (28 px) keep it fast; a few pictures
at the checkpoints' real sizes too."""

from __future__ import annotations

import dataclasses
import io
import json

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from tests.hf_reference import llava_processor
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.model.families.llava import anyres
from vlserve.model.families.llava.checks import check_item, item_tokens
from vlserve.model.families.llava.pixels import (
    DEFAULTS,
    anyres_pixels,
    load_settings,
    settings_from_dict,
    video_pixels,
)
from vlserve.model.families.llava.processor import LlavaProcessor
from vlserve.model.families.processor import ProcessorContext, PromptMedia
from vlserve.model.hf_config import load_model_config

OV, NV = "LlavaOnevisionForConditionalGeneration", "LlavaNextVideoForConditionalGeneration"
TINY = {OV: "llava_onevision", NV: "llava_next_video"}  # make-tiny-model --arch
S, PATCH = 28, 7  # the pixel-level tests' tile side and patch (the tiny checkpoints': 56 and 14)
OV_PIN = [[S * a, S * b] for a in range(1, 7) for b in range(1, 7)]
NV_PIN = [[S, 2 * S], [2 * S, S], [2 * S, 2 * S], [3 * S, S], [S, 3 * S]]
# preprocessor_config.json as the checkpoints hold them (OneVision: SigLIP's 0.5 mean/std; NeXT-Video: CLIP's)
SETTINGS = {
    OV: {"size": {"height": S, "width": S}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3,
         "do_pad": True, "image_grid_pinpoints": OV_PIN},
    NV: {"size": {"shortest_edge": S}, "crop_size": {"height": S, "width": S}, "do_center_crop": True, "resample": 3,
         "image_grid_pinpoints": NV_PIN},
}
HF_IMAGE = {OV: LlavaOnevisionImageProcessorPil, NV: LlavaNextImageProcessorPil}


def rng_image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def smooth_frames(n: int, h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([np.stack([(x * 3 + i * 20) % 256, (y * 4 + i * 9) % 256, (x + y) % 256], -1)
                     for i in range(n)]).astype(np.uint8)


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """arch -> (checkpoint folder, its ModelConfig, its tokenizer): the model side's tiny checkpoints."""
    made = {}
    for arch, name in TINY.items():
        folder = tiny_ckpt(name)
        made[arch] = (folder, load_model_config(folder), AutoTokenizer.from_pretrained(folder))
    return made


def make_processor(tiny, arch, *, limit=100_000, max_pixels=64_000_000, frames=32, embeds=False,
                   settings_from=None) -> LlavaProcessor:
    """The checkpoint's processor under these server bounds; `settings_from`: a folder of other processor files."""
    folder, cfg, tokenizer = tiny[arch]
    ctx = ProcessorContext(cfg, settings_from or folder, tokenizer, torch.float32, 8192,
                           (f"max_num_encoder_input_tokens={limit}", limit), max_pixels, frames, embeds, 30.0,
                           20 * 2**20, 200 * 2**20)
    return LlavaProcessor(ctx)


def prompt(proc: LlavaProcessor, text: str, images=(), videos=(), kwargs=None, uuids=None):
    tokenizer = proc.ctx.tokenizer
    media = {"image": [(m, (uuids or {}).get("image")) for m in images],
             "video": [(v, (uuids or {}).get("video")) for v in videos]}
    values = {"text": text, "token_ids": tokenizer.encode(text), "media": media, "mm_kwargs": kwargs or {},
              "from_token_ids": False, "tokenize": tokenizer.encode}
    names = {f.name for f in dataclasses.fields(PromptMedia)}
    return PromptMedia(**{k: v for k, v in values.items() if k in names})


@pytest.fixture(scope="module")
def hf_processors(tiny):
    """transformers' processors over each tiny checkpoint's files, with an image processor only (their video
    processors need torchvision, which is not installed): tests/hf_reference.py's `llava_processor`."""
    return {arch: llava_processor(folder, tokenizer) for arch, (folder, _, tokenizer) in tiny.items()}


def chat(tokenizer, parts: list[str], question: str = "What is this?") -> str:
    content = [{"type": kind} for kind in parts] + [{"type": "text", "text": question}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


# ---- pictures -----------------------------------------------------------------------------------------------
SIZES = [(1, 1), (5, 300), (300, 5), (28, 28), (27, 29), (40, 40), (28, 56), (56, 28), (50, 100), (100, 50),
         (77, 200), (200, 77), (123, 45), (84, 28), (28, 84), (168, 168), (169, 170), (150, 33), (33, 150),
         (99, 101), (180, 120), (120, 180), (13, 170), (170, 13), (500, 400)]


@pytest.mark.parametrize("arch", [OV, NV])
def test_anyres_pixels_equal_transformers(arch):
    hf = HF_IMAGE[arch](**SETTINGS[arch])
    ours = settings_from_dict(SETTINGS[arch], DEFAULTS[(arch, "image")])
    for k, (h, w) in enumerate(SIZES):
        img = rng_image(h, w, seed=k)
        ref = hf(img, return_tensors="np")["pixel_values"][0]
        got = anyres_pixels(img, ours)
        assert got.dtype == torch.float32 and got.shape == (ref.shape[0], 3 * S * S), (h, w)
        np.testing.assert_allclose(got.numpy(), ref.reshape(ref.shape[0], -1), atol=1e-6, rtol=0, err_msg=f"{h}x{w}")


@pytest.mark.parametrize("arch,size,extra", [
    (OV, 384, {"size": {"height": 384, "width": 384}, "image_grid_pinpoints": [[384 * a, 384 * b] for a in
                                                                                 range(1, 7) for b in range(1, 7)]}),
    (NV, 336, {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
               "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}),
    # other settings: other filters, no normalization, a rescale of its own, pinpoints off the tile size (edge
    # tiles resized), a crop from a larger shortest edge
    (OV, S, {"resample": 2, "do_normalize": False, "rescale_factor": 0.5 / 255, "image_grid_pinpoints": [[40, 70],
                                                                                                       [70, 40]]}),
    (NV, S, {"resample": 0, "size": {"shortest_edge": 32}, "image_grid_pinpoints": [[30, 60], [60, 30]]}),
])
def test_anyres_pixels_equal_transformers_other_settings(arch, size, extra):
    d = {**SETTINGS[arch], **extra}
    hf = HF_IMAGE[arch](**d)
    ours = settings_from_dict(d, DEFAULTS[(arch, "image")])
    for k, (h, w) in enumerate([(300, 500), (700, 200), (64, 64)] if size > S else SIZES[:12]):
        img = rng_image(h, w, seed=k)
        ref = hf(img, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(anyres_pixels(img, ours).numpy(), ref.reshape(ref.shape[0], -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", [OV, NV])
def test_prompt_equals_transformers_processor(arch, tiny, hf_processors):
    """Expanded input ids, pixel values and picture sizes of chat prompts with one or several pictures."""
    proc = make_processor(tiny, arch)
    cfg, tokenizer = proc.ctx.model, proc.ctx.tokenizer
    for k, sizes in enumerate([[(300, 500), (900, 120)], [(56, 56)], [(150, 150), (13, 170), (99, 101)],
                               [(168, 56), (1000, 800)], [(1, 1)]]):
        images = [rng_image(h, w, seed=10 * k + i) for i, (h, w) in enumerate(sizes)]
        text = chat(tokenizer, ["image"] * len(images))
        ref = hf_processors[arch](text=[text], images=images, return_tensors="np")
        out = proc.process(prompt(proc, text, images))
        assert out.prompt_token_ids == list(ref["input_ids"][0])
        assert out.positions.tolist() == [list(range(len(out.prompt_token_ids)))] and out.position_delta == 0
        for i, item in enumerate(out.mm_items):
            tiles = item.layout[0]
            assert item.layout == (tiles, *tuple(ref["image_sizes"][i]))
            np.testing.assert_allclose(item.pixel_values.numpy(), ref["pixel_values"][i][:tiles].reshape(tiles, -1),
                                       atol=1e-6, rtol=0)
            assert out.prompt_token_ids[item.offset:item.end] == [cfg.image_token_id] * item.num_tokens
            assert item.modality == "image"
            check_item(item, cfg)  # what the engine checks: grid, rows and pixel shape agree
        assert sum(t == cfg.image_token_id for t in out.prompt_token_ids) == sum(it.num_tokens for it in out.mm_items)


def test_token_counts_equal_transformers_for_many_sizes(tiny, hf_processors):
    """HF's own count (`_get_number_of_features`, less the CLS for "default") for pictures of every shape."""
    rng = np.random.default_rng(3)
    sizes = SIZES + [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(300)]
    for arch in (OV, NV):
        cfg, p = tiny[arch][1], hf_processors[arch]
        geo, side = anyres.Geometry.of(cfg), anyres.Geometry.of(cfg).image_size
        for h, w in sizes:
            want = p._get_number_of_features(h, w, side, side) - (arch == NV)
            assert item_tokens(cfg, (geo.num_tiles(h, w), h, w)) == want, (arch, h, w)


# ---- videos -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", [OV, NV])
def test_video_prompt_tokens_equal_transformers(arch, tiny, hf_processors):
    proc = make_processor(tiny, arch)
    cfg, tokenizer, side = proc.ctx.model, proc.ctx.tokenizer, anyres.Geometry.of(proc.ctx.model).image_size
    frames = smooth_frames(5, 40, 60)
    text = chat(tokenizer, ["image", "video"])
    out = proc.process(prompt(proc, text, [rng_image(60, 30)], [frames]))
    p = hf_processors[arch]
    if arch == OV:
        want = p._get_num_multimodal_tokens(video_sizes=[(5, side, side)])["num_video_tokens"][0]
    else:
        want = len(p.replace_video_token({"pixel_values_videos": [np.zeros((5, 3, side, side), np.float32)]}, 0)) // 7
    image, video = out.mm_items
    assert (video.modality, video.layout, video.num_tokens) == ("video", (5, 0, 0), want)
    assert video.pixel_values.shape == (5, 3 * side * side) and video.offset >= image.end
    expected = text.replace("<video>", "<video>" * want).replace("<image>", "<image>" * image.num_tokens)
    assert out.prompt_token_ids == tokenizer.encode(expected)
    check_item(video, cfg)


def hf_frame_reference(frames: np.ndarray, d: dict) -> np.ndarray:
    """transformers' BaseVideoProcessor._preprocess on CPU, step by step, written from its code: tvF.resize
    (uint8 antialiased bicubic), centre crop int((h - ch) / 2.0), (x - mean * 255) / (std * 255) in float32."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    size = d["size"]
    if "shortest_edge" in size:
        h, w = x.shape[-2:]
        short, long = min(h, w), max(h, w)
        new = (size["shortest_edge"], int(size["shortest_edge"] * long / short))
        new = new if h <= w else new[::-1]
    else:
        new = (size["height"], size["width"])
    if tuple(x.shape[-2:]) != new:
        x = torch.nn.functional.interpolate(x, size=list(new), mode="bicubic", align_corners=False, antialias=True)
    if d.get("do_center_crop"):
        ch, cw = d["crop_size"]["height"], d["crop_size"]["width"]
        top, left = int((x.shape[-2] - ch) / 2.0), int((x.shape[-1] - cw) / 2.0)
        x = x[..., top:top + ch, left:left + cw]
    mean = torch.tensor(d.get("image_mean", [0.48145466, 0.4578275, 0.40821073])) * 255.0
    std = torch.tensor(d.get("image_std", [0.26862954, 0.26130258, 0.27577711])) * 255.0
    return ((x.float() - mean.view(3, 1, 1)) / std.view(3, 1, 1)).reshape(len(frames), -1).numpy()


@pytest.mark.parametrize("arch", [OV, NV])
def test_video_frames_equal_transformers(arch):
    d = SETTINGS[arch]
    s = settings_from_dict(d, DEFAULTS[(arch, "video")])
    # the plain per-frame pipeline (resize, crop, rescale, normalize) in PIL
    plain = {k: v for k, v in d.items() if k != "image_grid_pinpoints"}
    hf = CLIPImageProcessorPil(**{"do_center_crop": False, **plain})
    # frames already at the resize target: only crop and normalization, where the PIL image processor agrees
    same = smooth_frames(3, S, S + 13) if arch == NV else smooth_frames(3, S, S)
    ref = np.stack([hf(Image.fromarray(f), return_tensors="np")["pixel_values"][0] for f in same])
    np.testing.assert_allclose(video_pixels(same, s).numpy(), ref.reshape(3, -1), atol=1e-6, rtol=0)
    for h, w in [(40, 60), (60, 40), (59, 40), (40, 59), (17, 23), (100, 100), (28, 200)]:
        frames = smooth_frames(4, h, w)
        got = video_pixels(frames, s)
        np.testing.assert_allclose(got.numpy(), hf_frame_reference(frames, d), atol=1e-6, rtol=0)
        # torch's resampling is not PIL's, by a level or two: still the same picture as HF's image pipeline
        pil = np.stack([hf(Image.fromarray(f), return_tensors="np")["pixel_values"][0] for f in frames])
        assert np.abs(got.numpy() - pil.reshape(4, -1)).mean() < 0.02


def encode_clip(n: int, h: int = 32, w: int = 48) -> bytes:
    """Frame i a flat grey of level 6 * i + 10 (recognisable after a lossy codec)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            frame = np.full((h, w, 3), 6 * i + 10, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_video_frame_sampling(tiny):
    """Decoded clips: every frame up to max_frames, else max_frames spread as vLLM's loader does (np.linspace
    truncated); arrays and frame lists: used whole up to max_frames, sampled the same way past it."""
    proc = make_processor(tiny, OV, frames=16)
    data = encode_clip(40)

    def frames_of(video, kwargs=None):
        item = proc.process(prompt(proc, "<video>", videos=[video], kwargs=kwargs)).mm_items[0]
        return item.layout[0], item

    n, item = frames_of(data)  # --max-video-frames=16
    assert n == 16
    levels = (item.pixel_values.view(16, 3, -1).mean(-1)[:, 0] * 0.5 + 0.5) * 255  # undo mean/std 0.5
    picked = np.rint((levels.numpy() - 10) / 6).astype(int)
    assert picked.tolist() == np.linspace(0, 39, 16).astype(int).tolist()
    assert frames_of(data, {"max_frames": 7})[0] == 7
    assert frames_of(encode_clip(5))[0] == 5  # a short clip: all of it
    array = smooth_frames(20, 30, 30)
    assert frames_of(array)[0] == 16
    assert frames_of(array[:9])[0] == 9 and frames_of(list(array[:3]))[0] == 3
    _, whole = frames_of(array[:9])
    np.testing.assert_array_equal(whole.pixel_values.numpy(), video_pixels(array[:9], proc.video).numpy())
    _, sampled = frames_of(array)
    idx = np.linspace(0, 19, 16).astype(int)
    np.testing.assert_array_equal(sampled.pixel_values.numpy(), video_pixels(array[idx], proc.video).numpy())
    for bad in (17, 0, -1, 2.5, True, "8"):
        with pytest.raises(InvalidInputError, match="max_frames"):
            frames_of(array, {"max_frames": bad})
    with pytest.raises(InvalidInputError, match="video"):
        frames_of(np.zeros((4, 30, 30), np.uint8))


# ---- bounds -------------------------------------------------------------------------------------------------
def test_too_many_tokens_refused_before_resizing(tiny, monkeypatch):
    import vlserve.model.families.llava.processor as module

    def never(*a, **k):
        raise AssertionError("resized before the bounds were checked")

    monkeypatch.setattr(module, "anyres_pixels", never)
    monkeypatch.setattr(module, "video_pixels", never)
    proc = make_processor(tiny, OV, limit=100)
    with pytest.raises(InvalidInputError, match=r"embedding tokens, more than the 100 one item may take here "
                                                r"\(max_num_encoder_input_tokens=100\)") as e:
        proc.process(prompt(proc, "<image>", [rng_image(500, 400)]))
    assert e.value.http_status == 400
    with pytest.raises(InvalidInputError, match="video of 30 frames would take .* send fewer frames"):
        proc.process(prompt(proc, "<video>", videos=[smooth_frames(30, 8, 8)]))


def test_too_many_pixels_refused(tiny, monkeypatch):
    import vlserve.model.families.llava.processor as module

    # the anyres canvas: a 100x100 picture goes to the 112x112 pinpoint (12544 pixels)
    proc = make_processor(tiny, OV, max_pixels=12_000)
    with pytest.raises(MediaTooLargeError, match=r"resized to 112x112 = 12544 pixels.*--max-image-pixels") as e:
        proc.process(prompt(proc, "<image>", [rng_image(100, 100)]))
    assert e.value.http_status == 413
    with pytest.raises(MediaTooLargeError):  # as decoded (vlserve.media.image's check)
        proc.process(prompt(proc, "<image>", [rng_image(120, 120)]))
    # NeXT-Video frames: the shortest edge goes to the tile side keeping the aspect, before the crop
    monkeypatch.setattr(module, "video_pixels", lambda *a: (_ for _ in ()).throw(AssertionError("resized")))
    proc = make_processor(tiny, NV, max_pixels=12_000)
    with pytest.raises(MediaTooLargeError, match=r"frames would be resized to 2800x56"):
        proc.process(prompt(proc, "<video>", videos=[smooth_frames(2, 2, 100)]))


def test_placeholder_count_must_match(tiny):
    proc = make_processor(tiny, NV)
    with pytest.raises(InvalidInputError, match="placeholder"):
        proc.process(prompt(proc, "describe <image> <image>", [rng_image(30, 30)]))
    with pytest.raises(InvalidInputError, match="placeholder"):
        proc.process(prompt(proc, "describe this", videos=[smooth_frames(2, 30, 30)]))


# ---- hashes -------------------------------------------------------------------------------------------------
def test_hashes(tiny, tmp_path):
    proc = make_processor(tiny, OV)

    def h(images=(), videos=(), uuids=None, kwargs=None, p=proc):
        text = " ".join(["<image>"] * len(images) + ["<video>"] * len(videos))
        return [it.mm_hash for it in p.process(prompt(p, text, images, videos, kwargs, uuids)).mm_items]

    img = rng_image(60, 90, seed=5)
    png = io.BytesIO()
    img.save(png, format="PNG")
    assert h([img]) == h([png.getvalue()])  # the same pixels, however sent
    assert h([img]) != h([rng_image(60, 90, seed=6)])
    folder = tiny[OV][0]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):  # settings that change the pixels
        other = dict(json.loads((folder / name).read_text()), image_mean=[0.4, 0.5, 0.5])
        (tmp_path / name).write_text(json.dumps(other))
    assert h([img]) != h([img], p=make_processor(tiny, OV, settings_from=tmp_path))
    assert h([img], uuids={"image": "a"}) == h([rng_image(10, 10)], uuids={"image": "a"})  # the client's id
    assert h([img], uuids={"image": "a"}) != h([img], uuids={"image": "b"})
    frames = smooth_frames(4, 20, 20)
    assert h(videos=[frames]) == h(videos=[list(frames)]) != h(videos=[frames[:3]])
    assert h(videos=[frames], uuids={"video": "v"}) != h(videos=[frames], uuids={"video": "v"},
                                                         kwargs={"max_frames": 3})
    assert h(videos=[frames]) != h(videos=[frames], p=make_processor(tiny, OV, settings_from=tmp_path))
    assert h(videos=[frames])[0] != h([img])[0]


# ---- precomputed embeddings ---------------------------------------------------------------------------------
def test_image_embeddings(tiny):
    proc = make_processor(tiny, NV, embeds=True)
    cfg = proc.ctx.model
    rows = make_processor(tiny, NV).process(prompt(proc, "<image>", [rng_image(50, 100)])).mm_items[0].num_tokens
    embeds = torch.randn(rows, cfg.text.hidden_size)
    out = proc.process(prompt(proc, "describe <image>", [{"image_embeds": embeds, "image_sizes": (50, 100)}]))
    item = out.mm_items[0]
    assert item.num_tokens == rows and item.pixel_values is None and torch.equal(item.embeddings, embeds)
    assert item.layout == (anyres.Geometry.of(cfg).num_tiles(50, 100), 50, 100)
    check_item(item, cfg)
    again = proc.process(prompt(proc, "<image>", [{"image_embeds": embeds[None], "image_sizes": torch.tensor(
        [50, 100])}])).mm_items[0]
    assert again.mm_hash == item.mm_hash
    for entry, match in [({"image_embeds": embeds}, "image_sizes"),
                         ({"image_embeds": embeds, "image_sizes": (500, 20)}, "shape"),
                         ({"image_embeds": embeds, "image_sizes": (50, True)}, "image_sizes"),
                         ({"image_embeds": embeds[:-1], "image_sizes": (50, 100)}, "shape"),
                         ({"image_embeds": embeds.to(torch.int32), "image_sizes": (50, 100)}, "dtype"),
                         ({"image_embeds": embeds * float("nan"), "image_sizes": (50, 100)}, "NaN")]:
        with pytest.raises(InvalidInputError, match=match):
            proc.process(prompt(proc, "<image>", [entry]))
    with pytest.raises(InvalidInputError, match="enable-mm-embeds"):
        make_processor(tiny, NV).process(prompt(proc, "<image>", [{"image_embeds": embeds, "image_sizes": (50, 100)}]))
    with pytest.raises(InvalidInputError, match="video embeddings"):
        proc.process(prompt(proc, "<video>", videos=[{"video_embeds": embeds}]))


# ---- settings -----------------------------------------------------------------------------------------------
def test_settings_are_read_where_transformers_reads_them(tiny, tmp_path):
    folder = tiny[NV][0]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(dict(video, image_mean=[0.1, 0.2, 0.3])))
    assert load_settings(tmp_path, NV, "video").mean == (0.1, 0.2, 0.3)
    assert load_settings(tmp_path, NV, "image").pinpoints == anyres.Geometry.of(tiny[NV][1]).pinpoints
    (tmp_path / "video_preprocessor_config.json").unlink()  # falls back to the image processor's file
    assert load_settings(tmp_path, NV, "video").crop == (56, 56)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": dict(video, image_std=[1, 1, 1])}))
    assert load_settings(tmp_path, NV, "video").std == (1.0, 1.0, 1.0)  # transformers 5's nested entry first
    image = json.loads((folder / "preprocessor_config.json").read_text())
    for change, match in [({"image_grid_pinpoints": [[56, 56], [112, 56]]}, "pinpoints"),  # not the model's
                          ({"crop_size": {"height": 64, "width": 64}, "size": {"shortest_edge": 64}}, "64px"),
                          ({"resample": 1}, "resample")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(image, **change)))
        with pytest.raises(ModelLoadError, match=match):
            make_processor(tiny, NV, settings_from=tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match="no image processor settings"):
        make_processor(tiny, NV, settings_from=tmp_path)
