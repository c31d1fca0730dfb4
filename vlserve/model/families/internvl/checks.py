"""The engine's check of an InternVL media item (whoever built it: a front end, an encoder service): its grid and
pixel values make exactly its token count.

Grids: a picture (num_tiles, original_height, original_width), or (num_tiles, 0, 0) for precomputed embeddings;
a video frame (1, 0, 0) (every frame is its own item). Pixel values: float32 [num_tiles, 3 * S * S].
"""

from __future__ import annotations

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem
from vlserve.model.config_types import ModelConfig
from vlserve.model.families.internvl.config import TILE_SIZE, tile_tokens

MAX_SIDE = 1 << 20  # a picture side (pixels) beyond any decoder's: refused before arithmetic on it


def item_tokens(cfg: ModelConfig, grid: tuple[int, int, int]) -> int:
    """Embedding rows (= placeholder tokens) of a grid: its tiles' rows."""
    return grid[0] * tile_tokens(cfg)


def item_pixel_rows(grid: tuple[int, int, int]) -> int:
    """Rows of pixel_values an item's grid takes: one per tile."""
    return grid[0]


def check_item(item: MultiModalItem, cfg: ModelConfig) -> None:
    t, h, w = tuple(item.layout)
    if item.modality not in ("image", "video"):
        raise InvalidInputError(f"{cfg.architecture} takes pictures and videos, not {item.modality}")
    if t <= 0 or not (0 <= h <= MAX_SIDE and 0 <= w <= MAX_SIDE) or (item.modality == "video" and (t, h, w) !=
                                                                      (1, 0, 0)):
        raise InvalidInputError(f"a {item.modality}'s grid {(t, h, w)} must be (tiles > 0, height, width) for a "
                                f"picture, (1, 0, 0) for a video frame")
    expected = item_tokens(cfg, (t, h, w))
    if item.num_tokens != expected:
        raise InvalidInputError(f"a {item.modality} of grid {(t, h, w)} takes {expected} tokens, not "
                                f"{item.num_tokens}")
    if item.pixel_values is not None:
        size = int(cfg.setting(TILE_SIZE))
        shape = (t, cfg.vision.in_channels * size * size)
        if item.pixel_values.dim() != 2 or tuple(item.pixel_values.shape) != shape:
            raise InvalidInputError(f"pixel values of shape {tuple(item.pixel_values.shape)} do not match grid "
                                    f"{(t, h, w)}; expected {shape}")
