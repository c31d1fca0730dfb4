"""Video decoding (PyAV) and Qwen2-VL / Qwen2.5-VL video preprocessing.

Frame sampling follows Qwen2-VL's `smart_nframes`: `fps` frames per second of video, within
[min_frames, max_frames], an even count (two frames make one temporal patch), spread evenly over the clip.
Each sampled frame is resized with `smart_resize`, its pixel budget being the total budget divided across
the frames; then pairs of frames become temporal patches in the same layout the image path uses for a
still picture (which is a pair of identical frames).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.frontend.media.image import ImageProcessorConfig, decode_base64, smart_resize, to_rgb

FRAME_FACTOR = 2  # frames per temporal patch
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 32
DEFAULT_TOTAL_PIXELS = 4096 * 28 * 28  # all sampled frames together
MAX_DECODED_FRAMES = 4096  # a longer stream is refused rather than held in memory


@dataclass(frozen=True)
class VideoOptions:
    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    total_pixels: int = DEFAULT_TOTAL_PIXELS

    def with_overrides(self, kwargs: dict, server_max_frames: int) -> "VideoOptions":
        """Per-request `mm_processor_kwargs` (fps, max_frames, total_pixels), never beyond the server's cap."""
        values = {"fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames,
                  "total_pixels": self.total_pixels}
        for key in ("fps", "max_frames", "total_pixels"):
            v = kwargs.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidInputError(f"{key} must be a positive number, got {v!r}")
            values[key] = v if key == "fps" else int(v)
        if values["max_frames"] > server_max_frames:
            raise InvalidInputError(f"max_frames {values['max_frames']} exceeds the server's limit of {server_max_frames}")
        values["min_frames"] = min(values["min_frames"], values["max_frames"])
        return VideoOptions(**values)


@dataclass
class SampledVideo:
    frames: list[np.ndarray]  # RGB uint8 [H, W, 3], the sampled frames in order
    sample_fps: float  # sampled frames per second of video


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: torch.Tensor  # float32 [t*h*w, 3 * temporal_patch_size * patch * patch]
    grid_thw: tuple[int, int, int]
    second_per_grid: float  # seconds of video one temporal patch covers
    merge_size: int = 2

    @property
    def num_embed_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


# ---- decoding ------------------------------------------------------------------------------------------
def _source_bytes(source: Any) -> Any:
    """A file path / data URL / bytes -> something `av.open` reads."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    if isinstance(source, os.PathLike):
        source = str(source)
    if isinstance(source, str):
        if source.startswith("data:"):
            head, sep, data = source.partition(",")
            if not sep or not head.endswith(";base64"):
                raise InvalidInputError("a video data URL must look like 'data:video/<type>;base64,<data>'")
            return io.BytesIO(decode_base64(data))
        path = Path(source.removeprefix("file://"))
        if not path.is_file():
            raise InvalidInputError(f"video file not found: {str(path)[:256]}")
        return str(path)
    raise InvalidInputError(f"unsupported video source type {type(source).__name__}")


def decode_video(source: Any) -> tuple[list, float]:
    """All frames of the first video stream (as PyAV frames, converted later) and the stream's fps."""
    import av

    try:
        container = av.open(_source_bytes(source))
    except (av.FFmpegError, ValueError, OSError) as e:
        raise InvalidInputError(f"the video could not be opened ({type(e).__name__}: {e})") from None
    with container:
        if not container.streams.video:
            raise InvalidInputError("the file has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        frames, times = [], []
        try:
            for frame in container.decode(stream):
                frames.append(frame)
                if frame.time is not None:
                    times.append(frame.time)
                if len(frames) > MAX_DECODED_FRAMES:
                    raise MediaTooLargeError(f"the video has more than {MAX_DECODED_FRAMES} frames")
        except av.FFmpegError as e:
            if not frames:
                raise InvalidInputError(f"the video could not be decoded ({type(e).__name__}: {e})") from None
            # a truncated tail: keep what decoded, like other players do
        if not frames:
            raise InvalidInputError("the video has no decodable frames")
        fps = _stream_fps(stream, container, times, len(frames))
    return frames, fps


def _stream_fps(stream, container, times: list[float], count: int) -> float:
    # vp9/webm streams may report no rate or frame count: fall back to timestamps, then container duration.
    rate = stream.average_rate or stream.guessed_rate
    if rate and float(rate) > 0:
        return float(rate)
    if len(times) >= 2 and times[-1] > times[0]:
        return (len(times) - 1) / (times[-1] - times[0])
    if container.duration:
        return count / (container.duration / 1e6)
    return DEFAULT_FPS


def frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """Qwen2-VL's smart_nframes: which of `total` frames to keep."""
    if total < 1:
        raise InvalidInputError("the video has no frames")
    wanted = total / video_fps * opts.fps
    lo = math.ceil(opts.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = max(FRAME_FACTOR, math.floor(min(opts.max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR)
    n = min(max(wanted, lo), hi, max(total, FRAME_FACTOR))
    n = max(FRAME_FACTOR, math.floor(n / FRAME_FACTOR) * FRAME_FACTOR)
    # a clip shorter than one temporal patch repeats its last frame
    return torch.linspace(0, total - 1, n).round().long().tolist()


def _to_array(frame: Any) -> np.ndarray:
    if isinstance(frame, np.ndarray):
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise InvalidInputError(f"video frames must be uint8 [H, W, 3] arrays, got {frame.dtype} {frame.shape}")
        return frame
    if isinstance(frame, Image.Image):
        return np.asarray(to_rgb(frame))
    return frame.to_ndarray(format="rgb24")  # a PyAV frame


def load_video(source: Any, opts: VideoOptions) -> SampledVideo:
    """A path / bytes / data URL (decoded with PyAV), or a list of frames taken as a clip at `opts.fps`."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise InvalidInputError("a video given as frames needs at least one frame")
        frames, fps = list(source), opts.fps
    else:
        frames, fps = decode_video(source)
    idx = frame_indices(len(frames), fps, opts)
    picked = [_to_array(frames[i]) for i in idx]
    if len({f.shape for f in picked}) != 1:
        raise InvalidInputError("all frames of a video must have the same size")
    return SampledVideo(picked, len(idx) / len(frames) * fps)


# ---- preprocessing ----------------------------------------------------------------------------------------
def preprocess_video(video: SampledVideo, cfg: ImageProcessorConfig, opts: VideoOptions,
                     min_pixels: int, max_pixels: int) -> ProcessedVideo:
    n = len(video.frames)
    h0, w0 = video.frames[0].shape[:2]
    per_frame = max(min(max_pixels, opts.total_pixels / n * FRAME_FACTOR), int(min_pixels * 1.05))
    h, w = smart_resize(h0, w0, cfg.factor, min_pixels, int(per_frame))
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
