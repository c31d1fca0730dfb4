"""Video: PyAV decoding (mp4/h264, webm/vp9), frame sampling, temporal patches equal to transformers' image path,
greedy parity with transformers for a video prompt and a mixed image + video prompt, caches, bad videos."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ARCHES, IMG, assert_pool_full, noise_image
from tests.hf_reference import HFReference
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.media.video import frame_indices, load_video
from vlserve.model.families.qwen.pixels import ImageProcessorConfig
from vlserve.model.families.qwen.video_rules import QwenVideoOptions, preprocess_video

VID = "<|vision_start|><|video_pad|><|vision_end|>"
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def clip_frames(n: int, h: int = 56, w: int = 84, seed: int = 0) -> list[np.ndarray]:
    """Smooth frames (a moving gradient plus noise) so lossy codecs keep them recognisable."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    frames = []
    for i in range(n):
        base = np.stack([(x * 3 + i * 20) % 256, (y * 4 + i * 10) % 256, (x + y + i * 30) % 256], -1)
        frames.append(np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8))
    return frames


def encode_video(frames: list[np.ndarray], fps: int, fmt: str = "mp4", codec: str = "libx264") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode_video(clip_frames(12, seed=1), fps=4)  # 3 s


# ---- decoding and sampling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,codec", [("mp4", "libx264"), ("webm", "libvpx-vp9")])
def test_decode_and_sample_by_fps(fmt, codec, tmp_path):
    data = encode_video(clip_frames(10), fps=5, fmt=fmt, codec=codec)  # 2 s at 5 fps
    path = tmp_path / f"clip.{fmt}"
    path.write_bytes(data)
    data_url = f"data:video/{fmt};base64," + base64.b64encode(data).decode()
    for source in (data, path, str(path), f"file://{path}", data_url):
        video = load_video(source, QwenVideoOptions(fps=2.0))
        assert len(video.frames) == 4 and video.frames[0].shape == (56, 84, 3)  # 2 s x 2 fps
        assert video.sample_fps == pytest.approx(2.0)


def test_frame_sampling_rules():
    opts = QwenVideoOptions(fps=2.0, min_frames=4, max_frames=16)
    assert frame_indices(300, 30.0, opts) == torch.linspace(0, 299, 16).round().long().tolist()  # capped
    assert len(frame_indices(30, 30.0, opts)) == 4  # 1 s -> 2 frames, raised to min_frames
    assert len(frame_indices(3, 30.0, opts)) == 2  # never more frames than the clip has, always even
    assert frame_indices(1, 30.0, opts) == [0, 0]  # a single frame fills one temporal patch
    assert all(len(frame_indices(n, 10.0, opts)) % 2 == 0 for n in range(1, 200))


def test_temporal_patches_equal_transformers_image_path(tiny_ckpt):
    """Each frame through transformers' image processor; pairs of frames must fill our temporal slots."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = tiny_ckpt("qwen2_vl")
    cfg = ImageProcessorConfig.from_pretrained(path)
    video = load_video(clip_frames(6, h=70, w=100), QwenVideoOptions(fps=2.0))  # a list of frames: a clip at fps
    out = preprocess_video(video, cfg, QwenVideoOptions(), cfg.min_pixels, cfg.max_pixels)
    t, gh, gw = out.layout
    h, w = gh * cfg.patch_size, gw * cfg.patch_size
    hf = Qwen2VLImageProcessorPil.from_pretrained(path, size={"shortest_edge": h * w, "longest_edge": h * w})
    per_frame = []
    for f in video.frames:
        resized = Image.fromarray(f).resize((w, h), resample=Image.Resampling.BICUBIC)
        pv = hf(images=[resized], return_tensors="pt")["pixel_values"]  # [gh*gw, C*2*p*p], both slots = frame
        per_frame.append(pv.view(gh * gw, 3, 2, cfg.patch_size, cfg.patch_size)[:, :, 0])
    expected = torch.cat([torch.stack([per_frame[2 * k], per_frame[2 * k + 1]], dim=2) for k in range(t)])
    torch.testing.assert_close(out.pixel_values, expected.reshape(t * gh * gw, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [b"", b"definitely not a video", "data:video/mp4;base64,@@@", "/no/such/file.mp4",
                                 "data:video/mp4,rawdata"])
def test_bad_videos_are_clear_errors(bad):
    with pytest.raises(InvalidInputError):
        load_video(bad, QwenVideoOptions())


def test_truncated_video_is_an_error_or_its_decodable_part(mp4):
    try:
        video = load_video(mp4[: len(mp4) // 3], QwenVideoOptions())
    except InvalidInputError:
        return
    assert len(video.frames) % 2 == 0 and video.frames


# ---- parity with transformers ------------------------------------------------------------------------------------
def hf_video_reference(hf: HFReference, llm: LLM, prompt: str, images: list, videos: list) -> tuple[list, list]:
    """transformers' generate with pixel_values_videos from our preprocessing (checked above against its image
    path), pictures from its own image processor, ids expanded by hand from the grids."""
    proc = llm.engine.input_processor.processor
    cfg, mcfg = proc.image_cfg, llm.config.model
    vids = [preprocess_video(load_video(v, proc.video_opts), cfg, proc.video_opts, cfg.min_pixels, cfg.max_pixels)
            for v in videos]
    ids = hf.tokenizer.encode(prompt)
    kwargs: dict = {}
    if images:
        im = hf.image_processor(images=images, return_tensors="pt")
        kwargs.update(pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"])
    kwargs.update(pixel_values_videos=torch.cat([v.pixel_values for v in vids]),
                  video_grid_thw=torch.tensor([v.layout for v in vids]))
    if mcfg.vision.time_scaled_video:
        kwargs["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in vids])
    counts = {mcfg.image_token_id: iter((kwargs["image_grid_thw"].prod(-1) // 4).tolist() if images else []),
              mcfg.video_token_id: iter([v.num_embed_tokens for v in vids])}
    ids = [t for tok in ids for t in ([tok] * next(counts[tok]) if tok in counts else [tok])]
    input_ids = torch.tensor([ids])
    types = (input_ids == mcfg.image_token_id).int() + 2 * (input_ids == mcfg.video_token_id).int()
    with torch.no_grad():
        out = hf.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                                max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                pad_token_id=hf.tokenizer.pad_token_id, **kwargs)
    return ids, out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=ARCHES)
def arch_setup(request, tiny_ckpt):
    path = tiny_ckpt(request.param)
    return HFReference(request.param, path), LLM(str(path), dtype="float32", num_kv_blocks=256,
                                                   limit_mm_per_prompt={"image": 2, "video": 2})


def test_video_prompt_matches_transformers(arch_setup, mp4):
    hf, llm = arch_setup
    prompt = f"<|im_start|>user\n{VID}What happens?<|im_end|>\n<|im_start|>assistant\n"
    expected_ids, expected = hf_video_reference(hf, llm, prompt, [], [mp4])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": mp4}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected_ids
    assert out.outputs[0].token_ids == expected
    other = encode_video(clip_frames(12, seed=9), fps=4)
    changed = llm.generate({"prompt": prompt, "multi_modal_data": {"video": other}}, GREEDY, use_tqdm=False)[0]
    assert changed.outputs[0].token_ids != expected, "the video does not reach the model"
    assert_pool_full(llm)


def test_mixed_image_and_video_prompt_matches_transformers(arch_setup, mp4):
    hf, llm = arch_setup
    frames = clip_frames(8, h=84, w=56, seed=4)  # a clip given as frames, taken at 2 fps
    image = noise_image(90, 60, 3)
    prompt = f"<|im_start|>user\nA {IMG} then {VID} and {VID}.<|im_end|>\n<|im_start|>assistant\n"
    expected_ids, expected = hf_video_reference(hf, llm, prompt, [image], [mp4, frames])
    # A small token budget also splits the video placeholders across steps (chunked prefill).
    chunked = LLM(str(llm.config.model_path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16,
                  limit_mm_per_prompt={"image": 2, "video": 2})
    for engine in (llm, chunked):
        out = engine.generate({"prompt": prompt,
                               "multi_modal_data": {"image": [image], "video": [mp4, np.stack(frames)]}},
                              GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == expected_ids
        assert out.outputs[0].token_ids == expected
        assert_pool_full(engine)


def test_repeated_video_hits_the_encoder_cache(arch_setup, mp4):
    _, llm = arch_setup
    fresh = encode_video(clip_frames(12, seed=21), fps=4)
    before = llm.get_metrics()
    prompt = {"prompt": f"{VID} again", "multi_modal_data": {"video": fresh}}
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)  # same prompt: the prefix cache holds the video's blocks
    mid = llm.get_metrics()
    assert mid["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 16
    llm.generate([{"prompt": f"Other text {VID}", "multi_modal_data": {"video": fresh}}], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["encoder_cache_hits_total"] - mid["encoder_cache_hits_total"] == 1


def test_video_limits(arch_setup, mp4):
    _, llm = arch_setup
    with pytest.raises(InvalidInputError, match="videos in one prompt"):
        llm.generate({"prompt": VID * 3, "multi_modal_data": {"video": [mp4] * 3}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="max_frames"):
        llm.generate({"prompt": VID, "multi_modal_data": {"video": mp4}}, GREEDY, use_tqdm=False,
                     mm_processor_kwargs={"max_frames": 10_000})
    few = llm.generate({"prompt": VID, "multi_modal_data": {"video": mp4}}, GREEDY, use_tqdm=False,
                       mm_processor_kwargs={"max_frames": 2})[0]
    many = llm.generate({"prompt": VID, "multi_modal_data": {"video": mp4}}, GREEDY, use_tqdm=False)[0]
    assert len(few.prompt_token_ids) < len(many.prompt_token_ids)
    assert_pool_full(llm)
