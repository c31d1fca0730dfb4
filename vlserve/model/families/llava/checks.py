"""The engine's check of a LLaVA media item (whoever built it: a front end, an encoder service): its grid and
pixel values make exactly its token count (geometry: vlserve.model.families.llava.anyres).

Grids: a picture (num_tiles, original_height, original_width), num_tiles 1 (base tile only) or the base and
every anyres tile; a video (num_frames, 0, 0). Pixel values: float32 [num_tiles or num_frames, 3 * S * S].
"""

from __future__ import annotations

from functools import cache

from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem
from vlserve.model.config_types import ModelConfig
from vlserve.model.families.llava.anyres import Geometry

MAX_SIDE = 1 << 20  # a picture side (pixels) beyond any decoder's: refused before arithmetic on it


@cache
def geometry(cfg: ModelConfig) -> Geometry:
    return Geometry.of(cfg)


def item_tokens(cfg: ModelConfig, grid: tuple[int, int, int]) -> int:
    """Embedding rows (= placeholder tokens) of a picture's or video's grid, image_newline rows included."""
    return geometry(cfg).item_rows(tuple(grid))


def item_pixel_rows(grid: tuple[int, int, int]) -> int:
    """Rows of pixel_values an item's grid takes: one per tile or frame."""
    return grid[0]


def check_grid(modality: str, grid: tuple[int, int, int], cfg: ModelConfig) -> None:
    """A grid the model can encode: InvalidInputError otherwise."""
    geo = geometry(cfg)
    t, h, w = grid
    if modality == "video":
        if t <= 0 or (h, w) != (0, 0):
            raise InvalidInputError(f"a video's grid {grid} must be (num_frames > 0, 0, 0)")
    elif modality == "image":
        if not (0 < h <= MAX_SIDE and 0 < w <= MAX_SIDE):
            raise InvalidInputError(f"a picture's grid {grid} must hold its height and width in pixels (1.."
                                    f"{MAX_SIDE})")
        if t != 1 and t != geo.num_tiles(h, w):
            raise InvalidInputError(f"a {h}x{w} picture is sent as 1 tile or {geo.num_tiles(h, w)} tiles, not {t}")
    else:
        raise InvalidInputError(f"{cfg.architecture} takes pictures and videos, not {modality}")


def check_item(item: MultiModalItem, cfg: ModelConfig) -> None:
    check_grid(item.modality, tuple(item.layout), cfg)
    expected = item_tokens(cfg, item.layout)
    if item.num_tokens != expected:
        raise InvalidInputError(f"a {item.modality} of grid {tuple(item.layout)} takes {expected} tokens, not "
                                f"{item.num_tokens}")
    if item.pixel_values is not None:
        size = geometry(cfg).image_size
        shape = (item.layout[0], cfg.vision.in_channels * size * size)
        if item.pixel_values.dim() != 2 or tuple(item.pixel_values.shape) != shape:
            raise InvalidInputError(f"pixel values of shape {tuple(item.pixel_values.shape)} do not match grid "
                                    f"{tuple(item.layout)}; expected {shape}")
