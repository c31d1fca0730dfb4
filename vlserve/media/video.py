"""Video decoding (PyAV) and frame sampling under bounds: what every family shares.

`load_video` / `decode_video` keep only the frames `VideoOptions.sampler` picks: a callable
`(total_frames, video_fps, opts) -> indices`, by default `uniform_frame_indices` (vLLM's default loader: at most
`max_frames` frames, evenly spread, whatever the frame rate; LLaVA and InternVL use it). A family with its own
sampling rules subclasses `VideoOptions` with its sampler and settings; how it then resizes the frames and lays them
out is its own too, kept in its folder (`vlserve/model/families/<family>/`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.media.data_url import decode_data_url, is_data_url
from vlserve.media.image import ImageBounds, to_rgb

DEFAULT_FPS = 2.0  # sampling rate of bare options; the rate of a stream that does not say, or of a list of frames
DEFAULT_MIN_FRAMES = 1
DEFAULT_MAX_FRAMES = 32
MAX_DECODED_FRAMES = 4096  # a longer stream is refused: decoding it would take minutes
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160  # 4K
DEFAULT_MAX_VIDEO_PIXELS = 32 * 3840 * 2160  # all sampled frames together, decoded (before resizing)

# Which of a clip's frames to keep: (frames in the clip, its frame rate, the options) -> frame indices, in order
# (an index may repeat). Called only for a clip of at least one frame.
FrameSampler = Callable[[int, float, "VideoOptions"], list[int]]


def uniform_frame_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """vLLM's default video loader (LLaVA, InternVL): every frame of a clip of at most `max_frames`, else
    `max_frames` spread evenly (numpy's float64 linspace, truncated to ints as `dtype=int` does)."""
    if total <= opts.max_frames:
        return list(range(total))
    return np.linspace(0, total - 1, opts.max_frames).astype(int).tolist()


@dataclass(frozen=True)
class VideoOptions:
    """How many frames to take from a clip, and (`sampler`) which. A family with other rules subclasses it: its
    own `sampler`, its own settings, and the request keys it takes in `overridable`."""

    fps: float = DEFAULT_FPS  # frames per second to sample (samplers that go by time); a list of frames' rate
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES

    # the `mm_processor_kwargs` a request may set (positive numbers; all but fps are taken as ints)
    overridable: ClassVar[tuple[str, ...]] = ("fps", "max_frames")

    @property
    def sampler(self) -> FrameSampler:
        return uniform_frame_indices

    def with_overrides(self, kwargs: dict, server_max_frames: int) -> VideoOptions:
        """Per-request `mm_processor_kwargs` (`overridable`), never beyond the server's frame cap."""
        values: dict[str, Any] = {}
        for key in self.overridable:
            v = kwargs.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidInputError(f"{key} must be a positive number, got {v!r}")
            values[key] = v if key == "fps" else int(v)
        max_frames = values.get("max_frames", self.max_frames)
        if max_frames > server_max_frames:
            raise InvalidInputError(f"max_frames {max_frames} exceeds the server's limit of "
                                    f"{server_max_frames} (--max-video-frames)")
        return replace(self, **values, min_frames=min(self.min_frames, max_frames))


@dataclass
class SampledVideo:
    frames: list[np.ndarray]  # RGB uint8 [H, W, 3], the sampled frames in order
    sample_fps: float  # sampled frames per second of video
    indices: list[int]  # which frames of the clip they are
    source_fps: float  # the clip's own frame rate (frames given as a list: taken at the requested fps)


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
    """Which of `total` frames to keep, by the options' sampler."""
    if total < 1:
        raise InvalidInputError("the video has no frames")
    return opts.sampler(total, video_fps, opts)


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
