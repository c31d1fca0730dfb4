"""The encoder's two budgets, sized so that no media item the server's bounds let in fails on them: the embedding
rows its cache holds (`encoder_cache_size`) and the tokens it runs in one step (`max_num_encoder_input_tokens`,
also the largest item the engine takes). Left unset, each is 16384 or what the largest item needs when that is
more (Qwen3-VL: a 16-megapixel picture is 16384 tokens of 4 cache rows each); set, it is the operator's, and an
item over it is refused at the front door with a 400 naming it (model.families.processor.ProcessorContext)."""

from __future__ import annotations

from pathlib import Path

from vlserve.core.config import DEFAULT_MAX_AUDIO_SECONDS, DEFAULT_MAX_PIXELS_DECODED, EngineArgs
from vlserve.model.config_types import ModelConfig
from vlserve.model.families import family_of
from vlserve.model.families.base import MediaBounds

DEFAULT_ENCODER_BUDGET = 16384


def media_bounds_of(args: EngineArgs, media: dict | None = None) -> MediaBounds:
    """`media`: `ServerArgs.media_bounds()` (None: every option's default)."""
    media = media or {}
    return MediaBounds(int(media.get("max_image_pixels", DEFAULT_MAX_PIXELS_DECODED)), args.max_video_frames,
                       float(media.get("max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)))


def largest_item_tokens(model: ModelConfig, folder: Path, bounds: MediaBounds) -> int:
    """The most embedding tokens one media item takes (0 for a model without media towers)."""
    if model.vision is None and model.audio is None:
        return 0
    family = family_of(model.architecture)
    return int(family.load(family.largest_item)(model, folder, bounds))


def encoder_budgets(args: EngineArgs, model: ModelConfig, folder: Path, bounds: MediaBounds) -> tuple[int, int]:
    """(encoder cache rows, encoder tokens per step): the options where set, else sized as the module says."""
    cache, step = args.encoder_cache_size, args.max_num_encoder_input_tokens
    if cache is None or step is None:
        largest = largest_item_tokens(model, folder, bounds)
        if cache is None:
            cache = max(DEFAULT_ENCODER_BUDGET, largest * model.rows_per_media_token)
        if step is None:
            step = max(DEFAULT_ENCODER_BUDGET, largest)
    return cache, step
