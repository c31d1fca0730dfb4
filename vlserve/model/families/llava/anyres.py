"""LLaVA picture and video geometry, shared by the processor (placeholder counts, tiling) and the model (packing):
pure Python, no torch, so the request path can import it cheaply.

A LLaVA picture is cut "anyres" style (LLaVA-NeXT): the checkpoint lists `image_grid_pinpoints`, resolutions
(height, width) that are multiples of the tower's square input size S; the picture goes to the best of them
(`best_resolution`, HF's `select_best_resolution`), which is cut into rows x cols tiles of S x S (`tile_grid`);
a base tile (the whole picture resized to S x S) comes first. Every tile makes an n x n feature grid
(n = S // patch). The model lays the anyres tiles' features side by side into one (rows*n) x (cols*n) grid,
crops the padding the resize-and-pad added back off (`unpadded_shape`, HF's `unpad_image`), LLaVA-OneVision
shrinks that grid by bilinear interpolation when it holds more than ~max_tiles tiles' worth (`anyres_max_9`,
`packed_shape`), and an `image_newline` row closes each grid row. Rows of a picture:

    n*n (base tile) + h * (w + 1) (packed grid (h, w) with one newline per row)

A picture sent as its base tile only (LLaVA-OneVision does that for every picture of a multi-picture prompt)
makes n*n + 1 rows (one newline after the base). A video frame is one S x S tile pooled to
`video_frame_side(n)` squared rows: OneVision bilinear to ceil(n/2) with one newline row after the whole video;
NeXT-Video average (or max) pooling by `spatial_pool_stride` (floor) and no newline.

Item grids (vlserve.core.prompt.MultiModalItem.layout): a picture (num_tiles, original_height,
original_width), a video (num_frames, 0, 0).

Settings (ModelConfig.family_settings, written by config.py; names are the keys of `SETTINGS` below) are read
through `Geometry.of(cfg)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# family_settings keys this module reads (config.py writes them)
IMAGE_SIZE = "image_size"  # S: the tower's square input side, in pixels
PATCH_SIZE = "patch_size"  # the tower's patch side, in pixels (also VisionConfig.patch_size)
GRID_PINPOINTS = "grid_pinpoints"  # flat (h1, w1, h2, w2, ...): image_grid_pinpoints, in pixels
MAX_TILES = "max_tiles"  # OneVision "anyres_max_9" -> 9; 0: no downscaling (NeXT-Video)
VIDEO_POOL = "video_pool"  # "bilinear" (OneVision: to ceil(n/2)), "average" / "max" (NeXT-Video, by the stride)
VIDEO_POOL_STRIDE = "video_pool_stride"  # NeXT-Video's spatial_pool_stride (2)
VIDEO_NEWLINE = "video_newline"  # True: one image_newline row after a video's frames (OneVision)
SETTINGS = (IMAGE_SIZE, PATCH_SIZE, GRID_PINPOINTS, MAX_TILES, VIDEO_POOL, VIDEO_POOL_STRIDE, VIDEO_NEWLINE)


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint (height, width) a picture of that size is resized (keeping its aspect) and padded to: the one
    keeping the most of its pixels, then the one wasting the least (transformers' `select_best_resolution`)."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    if best is None:
        raise ValueError(f"no grid pinpoint fits a {height}x{width} picture (pinpoints {list(pinpoints)})")
    return best


def unpadded_shape(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """The (rows, cols) left of a grid_h x grid_w feature grid once the padding around a height x width picture,
    resized to fit it, is cropped (transformers' `unpad_image`: the same padding off both sides)."""
    if width / height > grid_w / grid_h:  # wider than the grid: padded above and below
        new_h = int(round(height * (grid_w / width), 7))
        return grid_h - 2 * ((grid_h - new_h) // 2), grid_w
    new_w = int(round(width * (grid_h / height), 7))
    return grid_h, grid_w - 2 * ((grid_w - new_w) // 2)


def downscaled_shape(grid_h: int, grid_w: int, side: int, max_tiles: int) -> tuple[int, int]:
    """OneVision's anyres_max_N: a grid over ~1.1x N tiles' worth of side x side features is interpolated down to
    about N tiles' worth, keeping its aspect (transformers' `pack_image_features`, exact integer arithmetic)."""
    if max_tiles <= 0:
        return grid_h, grid_w
    ratio = math.sqrt(grid_h * grid_w / (max_tiles * side**2))
    if ratio > 1.1:
        return int(grid_h // ratio), int(grid_w // ratio)
    return grid_h, grid_w


@dataclass(frozen=True)
class Geometry:
    image_size: int  # S
    patch_size: int
    pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels, multiples of S
    max_tiles: int = 0  # OneVision: 9
    video_pool: str = "bilinear"  # "bilinear" | "average" | "max"
    video_pool_stride: int = 2
    video_newline: bool = False

    @classmethod
    def of(cls, cfg) -> Geometry:
        """The geometry of a parsed LLaVA ModelConfig (its family_settings)."""
        flat = tuple(cfg.setting(GRID_PINPOINTS, ()))
        return cls(image_size=int(cfg.setting(IMAGE_SIZE)), patch_size=int(cfg.setting(PATCH_SIZE)),
                   pinpoints=tuple(zip(flat[::2], flat[1::2])), max_tiles=int(cfg.setting(MAX_TILES, 0)),
                   video_pool=str(cfg.setting(VIDEO_POOL, "bilinear")),
                   video_pool_stride=int(cfg.setting(VIDEO_POOL_STRIDE, 2)),
                   video_newline=bool(cfg.setting(VIDEO_NEWLINE, False)))

    @property
    def side(self) -> int:
        """n: features per side of one tile."""
        return self.image_size // self.patch_size

    @property
    def tile_rows(self) -> int:
        """Feature rows of one tile (n*n)."""
        return self.side**2

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of S x S anyres tiles a height x width picture is cut into (the base tile not counted)."""
        h, w = best_resolution(height, width, self.pinpoints)
        return h // self.image_size, w // self.image_size

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles the model reads for a whole picture: the base tile and the anyres tiles."""
        rows, cols = self.tile_grid(height, width)
        return 1 + rows * cols

    def packed_shape(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) of a picture's anyres feature grid after unpadding (and OneVision's downscale); w + 1 with the
        newlines."""
        rows, cols = self.tile_grid(height, width)
        h, w = unpadded_shape(height, width, rows * self.side, cols * self.side)
        return downscaled_shape(h, w, self.side, self.max_tiles)

    def image_rows(self, num_tiles: int, height: int, width: int) -> int:
        """Embedding rows of a picture sent as `num_tiles` tiles: 1 (its base tile only: n*n + one newline) or
        `num_tiles(height, width)` (base + packed anyres grid with a newline per row)."""
        if num_tiles == 1:
            return self.tile_rows + 1
        h, w = self.packed_shape(height, width)
        return self.tile_rows + h * (w + 1)

    def video_frame_side(self) -> int:
        """Features per side of a pooled video frame."""
        if self.video_pool == "bilinear":
            return math.ceil(self.side / 2)
        return self.side // self.video_pool_stride

    def video_rows(self, num_frames: int) -> int:
        return num_frames * self.video_frame_side() ** 2 + int(self.video_newline)

    def item_rows(self, grid: tuple[int, int, int]) -> int:
        """Embedding rows of an item of grid (num_tiles, height, width) or a video's (num_frames, 0, 0)."""
        t, h, w = grid
        return self.video_rows(t) if (h, w) == (0, 0) else self.image_rows(t, h, w)
