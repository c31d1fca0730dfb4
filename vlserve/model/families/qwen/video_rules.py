"""Qwen-VL video rules: which frames to sample, the size they are resized to, and their temporal patches.

Qwen's own, so kept in its family folder (the shared media layer decodes a clip and keeps the frames the options'
sampler picks). Two sets of rules (`QwenVideoOptions.rules`), both spreading the sampled frames evenly over the clip:
- "qwen2" (Qwen2-VL, Qwen2.5-VL; qwen-vl-utils' `smart_nframes`): `fps` frames per second within
  [min_frames, max_frames], an even count; each frame resized with `smart_resize` to the total budget divided
  across the frames.
- "qwen3" (transformers' Qwen3VLVideoProcessor): `int(seconds * fps)` frames within [min_frames, max_frames] and
  the clip's length, any count (the last frame repeats to fill a temporal patch); one size for all frames from
  the 3-D `smart_resize` over (frames, height, width) with `min_pixels`..`total_pixels` for the whole clip.
Then pairs of frames become temporal patches in the same layout the image path uses for a still picture (a pair
of identical frames).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image

from vlserve.core.errors import InvalidInputError, ModelLoadError
from vlserve.media.video import FrameSampler, SampledVideo, VideoOptions
from vlserve.model.families.qwen.pixels import MAX_ASPECT_RATIO, ImageProcessorConfig, smart_resize

FRAME_FACTOR = 2  # frames per temporal patch
# "qwen2": what bare options hold (`for_model` takes the server's frame cap for max_frames)
QWEN2_FPS, QWEN2_MIN_FRAMES, QWEN2_MAX_FRAMES = 2.0, 4, 32
QWEN2_TOTAL_PIXELS = 4096 * 28 * 28  # all sampled frames together
# transformers' Qwen3VLVideoProcessor defaults, for a checkpoint whose video settings leave them out
QWEN3_FPS, QWEN3_MIN_FRAMES, QWEN3_MAX_FRAMES = 2.0, 4, 768
QWEN3_MIN_PIXELS, QWEN3_TOTAL_PIXELS = 128 * 32 * 32, 768 * 32 * 32


# ---- sampling -------------------------------------------------------------------------------------------------
def qwen2_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """qwen-vl-utils' smart_nframes."""
    wanted = total / video_fps * opts.fps
    lo = math.ceil(opts.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = max(FRAME_FACTOR, math.floor(min(opts.max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR)
    n = min(max(wanted, lo), hi, max(total, FRAME_FACTOR))
    n = max(FRAME_FACTOR, math.floor(n / FRAME_FACTOR) * FRAME_FACTOR)
    # a clip shorter than one temporal patch repeats its last frame
    return torch.linspace(0, total - 1, n).round().long().tolist()


def qwen3_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """transformers' Qwen3VLVideoProcessor.sample_frames (numpy's float64 linspace, as it uses)."""
    n = min(max(int(total / video_fps * opts.fps), opts.min_frames), opts.max_frames, total)
    return np.linspace(0, total - 1, max(n, 1)).round().astype(int).tolist()


FRAME_SAMPLERS: dict[str, FrameSampler] = {"qwen2": qwen2_frame_indices, "qwen3": qwen3_frame_indices}


@dataclass(frozen=True)
class QwenVideoOptions(VideoOptions):
    """The shared options with Qwen's rules (`sampler` by `rules`) and its clip-wide pixel budget."""

    fps: float = QWEN2_FPS
    min_frames: int = QWEN2_MIN_FRAMES
    max_frames: int = QWEN2_MAX_FRAMES
    total_pixels: int = QWEN2_TOTAL_PIXELS
    rules: str = "qwen2"  # which sampling and resizing rules (see the module docstring)
    min_pixels: int | None = None  # "qwen3": the whole clip's lower bound (None: the image processor's)
    max_frame_pixels: int | None = None  # "qwen3": the server's cap on one resized frame (--max-image-pixels)

    overridable: ClassVar[tuple[str, ...]] = ("fps", "max_frames", "total_pixels")

    @property
    def sampler(self) -> FrameSampler:
        return FRAME_SAMPLERS[self.rules]

    @classmethod
    def for_model(cls, folder: str | os.PathLike, rules: str, server_max_frames: int) -> QwenVideoOptions:
        """"qwen2": qwen-vl-utils' defaults. "qwen3": the checkpoint's `video_preprocessor_config.json`
        (transformers' defaults for what it leaves out). Never above the server's frame cap."""
        if rules not in FRAME_SAMPLERS:
            raise ModelLoadError(f"unknown video rules {rules!r}")
        path = Path(folder) / "video_preprocessor_config.json"
        if rules == "qwen2":
            return cls(max_frames=server_max_frames)
        if not path.is_file():
            return cls(QWEN3_FPS, min(QWEN3_MIN_FRAMES, server_max_frames), min(QWEN3_MAX_FRAMES, server_max_frames),
                       QWEN3_TOTAL_PIXELS, "qwen3", QWEN3_MIN_PIXELS)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            size = raw.get("size") or {}
            return cls(fps=float(raw.get("fps") or QWEN3_FPS),
                       min_frames=min(int(raw.get("min_frames", QWEN3_MIN_FRAMES)), server_max_frames),
                       max_frames=min(int(raw.get("max_frames", QWEN3_MAX_FRAMES)), server_max_frames),
                       total_pixels=int(size.get("longest_edge", QWEN3_TOTAL_PIXELS)),
                       rules="qwen3", min_pixels=int(size.get("shortest_edge", QWEN3_MIN_PIXELS)))
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: unreadable video settings ({type(e).__name__}: {e})") from e

    def with_overrides(self, kwargs: dict, server_max_frames: int,
                       max_frame_pixels: int | None = None) -> QwenVideoOptions:
        """Per-request `mm_processor_kwargs` (fps, max_frames, total_pixels), never beyond the server's caps
        (frames, and pixels of one resized frame)."""
        return replace(super().with_overrides(kwargs, server_max_frames), max_frame_pixels=max_frame_pixels)


def video_timestamps(video: SampledVideo, temporal_patch: int) -> list[float]:
    """Seconds into the clip of each temporal patch: the mean of its first and last frame's time (the last
    frame repeats to fill the final patch), as Qwen3-VL's processor writes them into the prompt."""
    idx = list(video.indices) + [video.indices[-1]] * (-len(video.indices) % temporal_patch)
    firsts = range(0, len(idx), temporal_patch)
    return [(idx[i] + idx[i + temporal_patch - 1]) / video.source_fps / 2 for i in firsts]


# ---- resizing and patches ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: torch.Tensor  # float32 [t*h*w, 3 * temporal_patch_size * patch * patch]
    layout: tuple[int, int, int]
    second_per_grid: float  # seconds of video one temporal patch covers
    merge_size: int = 2

    @property
    def num_embed_tokens(self) -> int:
        t, h, w = self.layout
        return t * h * w // self.merge_size**2


def video_grid(video: SampledVideo, cfg: ImageProcessorConfig, opts: QwenVideoOptions, min_pixels: int,
               max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) in patches that `preprocess_video` will produce, known before any frame is resized."""
    h, w = _frame_size(video, cfg, opts, min_pixels, max_pixels)
    tp = cfg.temporal_patch_size
    return (-(-len(video.frames) // tp), h // cfg.patch_size, w // cfg.patch_size)


def _frame_size(video: SampledVideo, cfg: ImageProcessorConfig, opts: QwenVideoOptions, min_pixels: int,
                max_pixels: int) -> tuple[int, int]:
    h0, w0 = video.frames[0].shape[:2]
    return FRAME_RESIZERS[opts.rules](len(video.frames), h0, w0, cfg, opts, min_pixels, max_pixels)


def _qwen2_frame_size(n: int, h0: int, w0: int, cfg: ImageProcessorConfig, opts: QwenVideoOptions, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """Each frame gets its share of the total budget, within the image bounds."""
    per_frame = max(min(max_pixels, opts.total_pixels / n * FRAME_FACTOR), int(min_pixels * 1.05))
    return smart_resize(h0, w0, cfg.factor, min_pixels, int(per_frame))


def _qwen3_frame_size(n: int, h0: int, w0: int, cfg: ImageProcessorConfig, opts: QwenVideoOptions, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize`: frames x height x width within the clip's pixel bounds."""
    factor, tp = cfg.factor, cfg.temporal_patch_size
    lo = opts.min_pixels if opts.min_pixels is not None else min_pixels
    if h0 < factor or w0 < factor:
        scale = max(factor / h0, factor / w0)
        h0, w0 = int(h0 * scale), int(w0 * scale)
    if max(h0, w0) / min(h0, w0) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"video aspect ratio {max(h0, w0) / min(h0, w0):.1f} exceeds {MAX_ASPECT_RATIO}")
    h, w = round(h0 / factor) * factor, round(w0 / factor) * factor
    t = max(round(n / tp), 1) * tp
    if t * h * w > opts.total_pixels:
        beta = math.sqrt(n * h0 * w0 / opts.total_pixels)
        h = max(factor, math.floor(h0 / beta / factor) * factor)
        w = max(factor, math.floor(w0 / beta / factor) * factor)
    elif t * h * w < lo:
        beta = math.sqrt(lo / (n * h0 * w0))
        h, w = math.ceil(h0 * beta / factor) * factor, math.ceil(w0 * beta / factor) * factor
    cap = opts.max_frame_pixels
    if cap is not None and h * w > cap:  # the server's cap shrinks the frames, as it shrinks a picture
        beta = math.sqrt(h0 * w0 / cap)
        h = max(factor, math.floor(h0 / beta / factor) * factor)
        w = max(factor, math.floor(w0 / beta / factor) * factor)
    return h, w


FRAME_RESIZERS = {"qwen2": _qwen2_frame_size, "qwen3": _qwen3_frame_size}


def preprocess_video(video: SampledVideo, cfg: ImageProcessorConfig, opts: QwenVideoOptions,
                     min_pixels: int, max_pixels: int) -> ProcessedVideo:
    n = len(video.frames)
    h0, w0 = video.frames[0].shape[:2]
    h, w = _frame_size(video, cfg, opts, min_pixels, max_pixels)
    resized = [f if (h, w) == (h0, w0) else
               np.asarray(Image.fromarray(f).resize((w, h), resample=Image.Resampling.BICUBIC)) for f in video.frames]
    pixels = torch.from_numpy(np.stack(resized))  # [T, h, w, 3] uint8
    tp = cfg.temporal_patch_size
    if n % tp:
        pixels = torch.cat([pixels, pixels[-1:].expand(tp - n % tp, -1, -1, -1)])
    grid = (pixels.shape[0] // tp, h // cfg.patch_size, w // cfg.patch_size)
    return ProcessedVideo(patchify_frames(pixels, cfg), grid, tp / video.sample_fps, cfg.merge_size)


def patchify_frames(frames: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """uint8 [T, H, W, C] (T a multiple of the temporal patch) -> normalized float32 [gt*gh*gw, C*tp*p*p].

    Rows go (temporal patch, window_row, window_col, row_in_window, col_in_window); each row is laid out
    (channel, frame in patch, py, px): the image layout with real frames in the temporal slots.
    """
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    t, h, w, c = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    src = frames.view(gt, tp, gh // m, m, p, gw // m, m, p, c).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    out = torch.empty((gt, gh // m, gw // m, m, m, c, tp, p, p), dtype=torch.float32)
    out.copy_(src)
    std = torch.tensor(cfg.image_std, dtype=torch.float64)
    scale = (cfg.rescale_factor / std).to(torch.float32).view(c, 1, 1, 1)
    shift = (torch.tensor(cfg.image_mean, dtype=torch.float64) / std).to(torch.float32).view(c, 1, 1, 1)
    out.mul_(scale).sub_(shift)
    return out.view(gt * gh * gw, c * tp * p * p)
