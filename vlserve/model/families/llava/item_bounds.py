"""The most embedding tokens one LLaVA media item takes under the server's bounds (vlserve.model.encoder_budgets
sizes the encoder's budgets to take it): a picture shaped like the largest grid pinpoint (no padding to crop
off), or a video of --max-video-frames frames."""

from __future__ import annotations

from pathlib import Path

from vlserve.model.config_types import ModelConfig
from vlserve.model.families.base import MediaBounds
from vlserve.model.families.llava.anyres import Geometry


def largest_item_tokens(model: ModelConfig, folder: Path, bounds: MediaBounds) -> int:
    if model.vision is None:
        return 0
    geo = Geometry.of(model)
    # a picture goes to its best pinpoint; one of exactly that shape keeps every row of it (unpadded_shape)
    pictures = [geo.image_rows(geo.num_tiles(h, w), h, w) for h, w in geo.pinpoints] or [geo.tile_rows + 1]
    return max(*pictures, geo.video_rows(bounds.max_video_frames))
