"""Video decoding (PyAV) and Qwen-VL video preprocessing.

Two sets of Qwen rules (`VideoOptions.rules`), both spreading the sampled frames evenly over the clip:
- "qwen2" (Qwen2-VL, Qwen2.5-VL; qwen-vl-utils' `smart_nframes`): `fps` frames per second within
  [min_frames, max_frames], an even count; each frame resized with `smart_resize` to the total budget divided
  across the frames.
- "qwen3" (transformers' Qwen3VLVideoProcessor): `int(seconds * fps)` frames within [min_frames, max_frames] and
  the clip's length, any count (the last frame repeats to fill a temporal patch); one size for all frames from
  the 3-D `smart_resize` over (frames, height, width) with `min_pixels`..`total_pixels` for the whole clip.
Then pairs of frames become temporal patches in the same layout the image path uses for a still picture (a pair
of identical frames). A third sampler, "uniform" (vLLM's default loader: at most `max_frames` frames, evenly
spread, whatever the frame rate), serves families that resize frames their own way (LLaVA): they use
`load_video` only.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.media.data_url import decode_data_url, is_data_url
from vlserve.media.image import MAX_ASPECT_RATIO, ImageBounds, ImageProcessorConfig, smart_resize, to_rgb

FRAME_FACTOR = 2  # frames per temporal patch
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 32
DEFAULT_TOTAL_PIXELS = 4096 * 28 * 28  # all sampled frames together
MAX_DECODED_FRAMES = 4096  # a longer stream is refused: decoding it would take minutes
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160  # 4K
DEFAULT_MAX_VIDEO_PIXELS = 32 * 3840 * 2160  # all sampled frames together, decoded (before resizing)
# transformers' Qwen3VLVideoProcessor defaults, for a checkpoint whose video settings leave them out
QWEN3_FPS, QWEN3_MIN_FRAMES, QWEN3_MAX_FRAMES = 2.0, 4, 768
QWEN3_MIN_PIXELS, QWEN3_TOTAL_PIXELS = 128 * 32 * 32, 768 * 32 * 32


@dataclass(frozen=True)
class VideoOptions:
    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    total_pixels: int = DEFAULT_TOTAL_PIXELS
    rules: str = "qwen2"  # which sampling and resizing rules (see the module docstring)
    min_pixels: int | None = None  # "qwen3": the whole clip's lower bound (None: the image processor's)
    max_frame_pixels: int | None = None  # "qwen3": the server's cap on one resized frame (--max-image-pixels)

    @classmethod
    def for_model(cls, folder: str | os.PathLike, rules: str, server_max_frames: int) -> "VideoOptions":
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
                       max_frame_pixels: int | None = None) -> "VideoOptions":
        """Per-request `mm_processor_kwargs` (fps, max_frames, total_pixels), never beyond the server's caps
        (frames, and pixels of one resized frame)."""
        values = {"fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames,
                  "total_pixels": self.total_pixels, "rules": self.rules, "min_pixels": self.min_pixels,
                  "max_frame_pixels": max_frame_pixels}
        for key in ("fps", "max_frames", "total_pixels"):
            v = kwargs.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidInputError(f"{key} must be a positive number, got {v!r}")
            values[key] = v if key == "fps" else int(v)
        if values["max_frames"] > server_max_frames:
            raise InvalidInputError(f"max_frames {values['max_frames']} exceeds the server's limit of "
                                    f"{server_max_frames} (--max-video-frames)")
        values["min_frames"] = min(values["min_frames"], values["max_frames"])
        return VideoOptions(**values)


@dataclass
class SampledVideo:
    frames: list[np.ndarray]  # RGB uint8 [H, W, 3], the sampled frames in order
    sample_fps: float  # sampled frames per second of video
    indices: list[int]  # which frames of the clip they are
    source_fps: float  # the clip's own frame rate (frames given as a list: taken at the requested fps)

    def timestamps(self, temporal_patch: int) -> list[float]:
        """Seconds into the clip of each temporal patch: the mean of its first and last frame's time (the last
        frame repeats to fill the final patch), as Qwen3-VL's processor writes them into the prompt."""
        idx = list(self.indices) + [self.indices[-1]] * (-len(self.indices) % temporal_patch)
        firsts = range(0, len(idx), temporal_patch)
        return [(idx[i] + idx[i + temporal_patch - 1]) / self.source_fps / 2 for i in firsts]


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
        if is_data_url(source):
            return io.BytesIO(decode_data_url(source, kind="video"))
        path = Path(source.removeprefix("file://"))
        if not path.is_file():
            raise InvalidInputError(f"video file not found: {str(path)[:256]}")
        return str(path)
    raise InvalidInputError(f"unsupported video source type {type(source).__name__}")


def _open(source: Any):
    import av

    try:
        return av.open(source)
    except (av.FFmpegError, ValueError, OSError) as e:
        raise InvalidInputError(f"the video could not be opened ({type(e).__name__}: {e})") from None


def _frames(container):
    """Decoded frames of the first video stream; a corrupt tail ends the stream, like other players do."""
    import av

    if not container.streams.video:
        raise InvalidInputError("the file has no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    count = 0
    try:
        for frame in container.decode(stream):
            count += 1
            if count > MAX_DECODED_FRAMES:
                raise MediaTooLargeError(f"the video has more than {MAX_DECODED_FRAMES} frames")
            yield frame
    except av.FFmpegError as e:
        if not count:
            raise InvalidInputError(f"the video could not be decoded ({type(e).__name__}: {e})") from None


def _count_frames(source: Any) -> tuple[int, float]:
    """Frame count and fps by decoding without keeping anything (streams whose header does not say)."""
    times, count = [], 0
    with _open(source()) as container:
        for frame in _frames(container):
            count += 1
            if frame.time is not None:
                times.append(frame.time)
        stream = container.streams.video[0]
        return count, _stream_fps(stream, container, times, count)


def decode_video(source: Any, opts: VideoOptions, max_frame_pixels: int | ImageBounds,
                 max_total_pixels: int) -> SampledVideo:
    """Only the sampled frames of the first video stream are kept (decoding streams past the others), and only
    within the per-frame and total pixel budgets (and a frame's shape bounds, when `max_frame_pixels` is an
    ImageBounds), checked before any frame is converted."""
    data = _source_bytes(source)
    reopen = (lambda: io.BytesIO(data.getvalue())) if isinstance(data, io.BytesIO) else (lambda: data)
    with _open(reopen()) as container:
        stream = container.streams.video[0] if container.streams.video else None
        total = stream.frames if stream is not None else 0
        rate = (stream.average_rate or stream.guessed_rate) if stream is not None else None
        fps = float(rate) if rate and float(rate) > 0 else 0.0
    if total <= 0 or fps <= 0:
        total, fps = _count_frames(reopen)
    for _ in range(2):  # a second pass when the header's frame count was wrong (e.g. a truncated file)
        idx = frame_indices(total, fps, opts)
        wanted: dict[int, int] = {}
        for i in idx:
            wanted[i] = wanted.get(i, 0) + 1
        picked: list[np.ndarray] = []
        decoded = 0
        with _open(reopen()) as container:
            for n, frame in enumerate(_frames(container)):
                decoded = n + 1
                if n == 0:
                    _check_pixels(frame.width, frame.height, len(idx), max_frame_pixels, max_total_pixels)
                if n in wanted:
                    picked += [frame.to_ndarray(format="rgb24")] * wanted[n]
                if n >= idx[-1]:
                    break
        if not decoded:
            raise InvalidInputError("the video has no decodable frames")
        if len(picked) == len(idx):
            return SampledVideo(picked, len(idx) / total * fps, idx, fps)
        total = decoded  # fewer frames than the header said: sample again over the real count
    raise InvalidInputError("the video's frames could not be sampled (inconsistent frame count)")


def _check_pixels(width: int, height: int, frames: int, max_frame_pixels: int | ImageBounds,
                  max_total_pixels: int) -> None:
    if isinstance(max_frame_pixels, ImageBounds):
        bounds, max_frame_pixels = max_frame_pixels, max_frame_pixels.max_pixels
    else:
        bounds = None
    if width <= 0 or height <= 0:
        raise InvalidInputError(f"video frames have an empty size {width}x{height}")
    if width * height > max_frame_pixels:
        raise MediaTooLargeError(f"video frames are {width}x{height} = {width * height} pixels, more than the "
                                 f"{max_frame_pixels} allowed per frame (--max-image-pixels)")
    if frames * width * height > max_total_pixels:
        raise MediaTooLargeError(f"{frames} sampled frames of {width}x{height} exceed the decoded-video budget of "
                                 f"{max_total_pixels} pixels: ask for fewer frames (max_frames in mm_processor_kwargs, "
                                 "or a lower --max-video-frames) or send smaller ones")
    if bounds is not None:
        bounds.check_shape(width, height, "a video frame")


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
    """Which of `total` frames to keep, by the rules `opts` names."""
    if total < 1:
        raise InvalidInputError("the video has no frames")
    return FRAME_SAMPLERS[opts.rules](total, video_fps, opts)


def _qwen2_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """qwen-vl-utils' smart_nframes."""
    wanted = total / video_fps * opts.fps
    lo = math.ceil(opts.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = max(FRAME_FACTOR, math.floor(min(opts.max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR)
    n = min(max(wanted, lo), hi, max(total, FRAME_FACTOR))
    n = max(FRAME_FACTOR, math.floor(n / FRAME_FACTOR) * FRAME_FACTOR)
    # a clip shorter than one temporal patch repeats its last frame
    return torch.linspace(0, total - 1, n).round().long().tolist()


def _qwen3_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """transformers' Qwen3VLVideoProcessor.sample_frames (numpy's float64 linspace, as it uses)."""
    n = min(max(int(total / video_fps * opts.fps), opts.min_frames), opts.max_frames, total)
    return np.linspace(0, total - 1, max(n, 1)).round().astype(int).tolist()


def _uniform_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """vLLM's default video loader (LLaVA): every frame of a clip of at most `max_frames`, else `max_frames`
    spread evenly (numpy's float64 linspace, truncated to ints as `dtype=int` does)."""
    if total <= opts.max_frames:
        return list(range(total))
    return np.linspace(0, total - 1, opts.max_frames).astype(int).tolist()


FRAME_SAMPLERS = {"qwen2": _qwen2_frame_indices, "qwen3": _qwen3_frame_indices, "uniform": _uniform_frame_indices}


def _to_array(frame: Any) -> np.ndarray:
    if isinstance(frame, np.ndarray):
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise InvalidInputError(f"video frames must be uint8 [H, W, 3] arrays, got {frame.dtype} {frame.shape}")
        return frame
    if isinstance(frame, Image.Image):
        return np.asarray(to_rgb(frame))
    return frame.to_ndarray(format="rgb24")  # a PyAV frame


def load_video(source: Any, opts: VideoOptions, max_frame_pixels: int | ImageBounds = DEFAULT_MAX_FRAME_PIXELS,
               max_total_pixels: int = DEFAULT_MAX_VIDEO_PIXELS) -> SampledVideo:
    """A path / bytes / data URL (decoded with PyAV), or a list of frames taken as a clip at `opts.fps`.
    `max_frame_pixels`: a frame's pixel cap, or a model family's `ImageBounds` (its cap, sides, aspect ratio),
    checked on the first decoded frame before any frame is converted or resized."""
    if not isinstance(source, (list, tuple)):
        return decode_video(source, opts, max_frame_pixels, max_total_pixels)
    if not source:
        raise InvalidInputError("a video given as frames needs at least one frame")
    idx = frame_indices(len(source), opts.fps, opts)
    picked = [_to_array(source[i]) for i in idx]
    if len({f.shape for f in picked}) != 1:
        raise InvalidInputError("all frames of a video must have the same size")
    h, w = picked[0].shape[:2]
    _check_pixels(w, h, len(idx), max_frame_pixels, max_total_pixels)
    return SampledVideo(picked, len(idx) / len(source) * opts.fps, idx, opts.fps)


# ---- preprocessing ----------------------------------------------------------------------------------------
def video_grid(video: SampledVideo, cfg: ImageProcessorConfig, opts: VideoOptions, min_pixels: int,
               max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) in patches that `preprocess_video` will produce, known before any frame is resized."""
    h, w = _frame_size(video, cfg, opts, min_pixels, max_pixels)
    tp = cfg.temporal_patch_size
    return (-(-len(video.frames) // tp), h // cfg.patch_size, w // cfg.patch_size)


def _frame_size(video: SampledVideo, cfg: ImageProcessorConfig, opts: VideoOptions, min_pixels: int,
                max_pixels: int) -> tuple[int, int]:
    h0, w0 = video.frames[0].shape[:2]
    return FRAME_RESIZERS[opts.rules](len(video.frames), h0, w0, cfg, opts, min_pixels, max_pixels)


def _qwen2_frame_size(n: int, h0: int, w0: int, cfg: ImageProcessorConfig, opts: VideoOptions, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """Each frame gets its share of the total budget, within the image bounds."""
    per_frame = max(min(max_pixels, opts.total_pixels / n * FRAME_FACTOR), int(min_pixels * 1.05))
    return smart_resize(h0, w0, cfg.factor, min_pixels, int(per_frame))


def _qwen3_frame_size(n: int, h0: int, w0: int, cfg: ImageProcessorConfig, opts: VideoOptions, min_pixels: int,
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


def preprocess_video(video: SampledVideo, cfg: ImageProcessorConfig, opts: VideoOptions,
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
