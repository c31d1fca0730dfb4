"""InternVL's dynamic tiling (transformers' GotOcr2 image processor with `crop_to_patches`): pure Python, so the
request path and the engine's checks import it cheaply.

A picture is resized to a canvas of cols x rows tiles of S x S pixels, the arrangement (with between
`min_tiles` and `max_tiles` tiles) whose aspect is closest to the picture's; on a tie the one with more tiles,
while the picture's area exceeds half the canvas's. The tiles are cut row by row; a picture cut into more than
one tile is followed by a thumbnail (the whole picture at S x S). Each tile makes `tile_tokens` embedding rows.
"""

from __future__ import annotations

from functools import cache


@cache
def arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with min_tiles <= cols * rows <= max_tiles, fewest tiles first (a stable sort of
    cols-major order, as the reference lists them)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


@cache
def canvas(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(cols, rows) of the canvas a height x width picture is resized to."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in arrangements(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def num_tiles(height: int, width: int, tile: int, min_tiles: int, max_tiles: int, thumbnail: bool = True) -> int:
    """Tiles of a picture: the canvas's, plus the thumbnail when there are several (1 when tiling is off)."""
    if max_tiles <= 1:
        return 1
    cols, rows = canvas(height, width, tile, min_tiles, max_tiles)
    return cols * rows + (1 if thumbnail and cols * rows > 1 else 0)
