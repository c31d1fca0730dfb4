"""The most embedding tokens one Qwen media item takes under the server's bounds, as a request without
mm_processor_kwargs is processed (vlserve.model.encoder_budgets sizes the encoder's budgets to take it): the same
rules as the processor's, worked out for the worst case instead of for one picture, video or clip."""

from __future__ import annotations

import math
from pathlib import Path

from vlserve.media.audio import AudioLimits, AudioProcessorConfig
from vlserve.media.audio_features import valid_frames
from vlserve.model.audio_encoder import audio_output_tokens
from vlserve.model.config_types import ModelConfig
from vlserve.model.families.base import MediaBounds
from vlserve.model.families.qwen.pixels import ImageProcessorConfig, resolve_pixel_limits
from vlserve.model.families.qwen.processor import audio_defaults
from vlserve.model.families.qwen.video_rules import FRAME_FACTOR, QwenVideoOptions


def largest_item_tokens(model: ModelConfig, folder: Path, bounds: MediaBounds) -> int:
    largest = 0
    if model.vision is not None:
        cfg = ImageProcessorConfig.from_pretrained(folder)
        lo, hi = resolve_pixel_limits(cfg, cap=bounds.max_image_pixels)
        largest = max(largest, _tokens(max(hi, lo), cfg.factor))  # smart_resize stays within [lo, hi]
        opts = QwenVideoOptions.for_model(folder, model.video_rules, bounds.max_video_frames)
        largest = max(largest, _largest_video_item(cfg, opts, lo, hi, bounds.max_image_pixels))
    if model.audio is not None:
        audio = AudioProcessorConfig.from_pretrained(folder, audio_defaults(model))
        limits = AudioLimits.for_model(audio, bounds.max_audio_seconds)
        largest = max(largest, audio_output_tokens(valid_frames(limits.max_samples, audio)))
    return largest


def _largest_video_item(cfg: ImageProcessorConfig, opts: QwenVideoOptions, lo: int, hi: int,
                        max_frame_pixels: int) -> int:
    if opts.rules == "qwen3":
        # one item per temporal patch; the clip's budget is shared by at least one patch of frames, and the
        # server's cap shrinks a frame as it shrinks a picture (video_rules._qwen3_frame_size)
        lower = opts.min_pixels if opts.min_pixels is not None else lo
        frame = max(min(opts.total_pixels // cfg.temporal_patch_size, max_frame_pixels), lower)
        return _tokens(frame, cfg.factor)
    # "qwen2": one item for the clip; each of its n frames gets its share of the total (video_rules._qwen2_frame_size)
    largest = 0
    for n in range(FRAME_FACTOR, max(opts.max_frames, FRAME_FACTOR) + 1, FRAME_FACTOR):
        frame = max(min(hi, opts.total_pixels / n * FRAME_FACTOR), int(lo * 1.05))
        largest = max(largest, n // FRAME_FACTOR * _tokens(max(int(frame), lo), cfg.factor))
    return largest


def _tokens(pixels: int, factor: int) -> int:
    """Tokens of a frame of at most `pixels` pixels whose sides are multiples of `factor` (one per factor²)."""
    return math.ceil(pixels / factor**2)
