"""The most embedding tokens one InternVL media item takes under the server's bounds (vlserve.model.encoder_budgets
sizes the encoder's budgets to take it): a picture cut into the checkpoint's most tiles plus its thumbnail (a video
is one item per frame, each one tile)."""

from __future__ import annotations

from pathlib import Path

from vlserve.model.config_types import ModelConfig
from vlserve.model.families.base import MediaBounds
from vlserve.model.families.internvl.config import tile_tokens
from vlserve.model.families.internvl.pixels import load_settings


def largest_item_tokens(model: ModelConfig, folder: Path, bounds: MediaBounds) -> int:
    if model.vision is None:
        return 0
    image = load_settings(folder, "image")
    tiles = image.max_tiles + 1 if image.max_tiles > 1 else 1  # the canvas's tiles and the thumbnail
    return tiles * tile_tokens(model)
