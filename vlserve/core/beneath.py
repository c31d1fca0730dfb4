"""Opening a path inside an allowed folder so that no symlink leads out of it, not even one swapped in after the
path was checked (runtime LoRA loads under --lora-dir, local media under --allowed-local-media-path).

The path is resolved once (`resolve_beneath`: symlinks inside the folder are fine then, `..` collapsed) and must lie
in one of the roots; `open_beneath` then opens it from that root down, one component at a time, following none of
them if it is a symlink (O_NOFOLLOW). A component swapped for a symlink after the check makes the open fail
(ELOOP, ENOTDIR): it never reads elsewhere. Standard library only.
"""

from __future__ import annotations

import errno
import os

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO in place of a file never hangs us


def root_of(real: str, roots) -> str | None:
    """The root `real` lies in (itself included), both resolved paths; None when outside all of them."""
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return root
    return None


def resolve_beneath(path: str, roots) -> tuple[str, str] | None:
    """(`path` resolved, the root it lies in); None when it lies outside every root (`roots`: resolved folders).
    OSError or ValueError (a NUL in it) when it cannot be resolved."""
    real = os.path.realpath(path)
    root = root_of(real, roots)
    return None if root is None else (real, root)


def open_beneath(root: str, real: str, flags: int = FILE_FLAGS) -> int:
    """`real` (resolved, inside `root`) opened with `flags` (DIR_FLAGS for a folder), walked to from `root` without
    following a symlink; `root` itself is opened as configured. OSError when a component is missing, not a folder,
    unreadable, or a symlink now. The caller checks what the descriptor is (fstat)."""
    if root_of(real, (root,)) is None:
        raise PermissionError(errno.EACCES, "outside the allowed folder", real)
    if real == root:
        return os.open(root, flags & ~os.O_NOFOLLOW)
    parts = os.path.relpath(real, root).split(os.sep)
    fd = os.open(root, DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            step = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = step
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)
