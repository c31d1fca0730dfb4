"""The C allocator of a front end (an HTTP server, run-batch): a large block goes back to the OS when it is freed.

glibc serves a block of M_MMAP_THRESHOLD bytes or more with a mapping of its own, unmapped when freed; but each
such free raises the threshold to that block's size (up to 32 MiB), so after one large upload the next ones come
from the arenas of the threads that handle them, and an arena keeps what is freed in it. Uploads of 17 MB, four
at a time, grew a transcription front end by 330-390 MB that stayed (benchmarks/transcription_rss.py; with the
threshold fixed, 80-90 MB). A fixed threshold stops the raising. Only front ends set it: the engine process keeps
glibc's default, which keeps its tensors' memory at hand between steps.
"""

from __future__ import annotations

import ctypes

LARGE_BLOCK_BYTES = 4 << 20  # blocks this large (uploads, their text, decoded media) are mapped, and unmapped on free
_M_MMAP_THRESHOLD = -3  # <malloc.h>


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fixes glibc's mmap threshold at `threshold` bytes for this process. False where the C library has no
    `mallopt` or refuses it (not glibc): nothing changes there."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
