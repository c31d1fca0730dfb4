"""Files opened inside an allowed folder (vlserve.core.beneath): a path is resolved once and opened from the folder
down without following a symlink, so a folder swapped for a symlink after the check (or a symlink leading out)
is refused, for local media (--allowed-local-media-path) as for runtime LoRA loads (tests/test_lora_hostile.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from vlserve.core.beneath import DIR_FLAGS, open_beneath, resolve_beneath
from vlserve.core.errors import MediaFetchError
from vlserve.media.fetch import MediaFetcher, MediaPolicy

PICTURE, SECRET = b"\x89PNG inside", b"secret outside"


@pytest.fixture
def tree(tmp_path: Path):
    """allowed/sub/img.png, allowed/inner (a symlink to sub), outside/img.png (the same name, other bytes)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "img.png").write_bytes(PICTURE)
    (outside / "img.png").write_bytes(SECRET)
    (allowed / "inner").symlink_to(allowed / "sub")
    return allowed, outside


def _read(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _swap(allowed: Path, outside: Path) -> None:
    (allowed / "sub").rename(allowed / "sub-kept")
    (allowed / "sub").symlink_to(outside)


def test_a_resolved_path_opens_beneath_its_root_and_a_swapped_folder_does_not(tree):
    allowed, outside = tree
    roots = (os.path.realpath(allowed),)
    real, root = resolve_beneath(str(allowed / "inner" / "img.png"), roots)  # a symlink inside: resolved
    assert _read(open_beneath(root, real)) == PICTURE
    assert resolve_beneath(str(allowed / ".." / "outside" / "img.png"), roots) is None
    os.close(open_beneath(root, os.path.join(root, "sub"), DIR_FLAGS))
    _swap(allowed, outside)
    for path, flags in ((real, os.O_RDONLY), (os.path.join(root, "sub"), DIR_FLAGS)):
        with pytest.raises(OSError):
            os.close(open_beneath(root, path, flags))
    with pytest.raises(PermissionError):
        open_beneath(root, str(outside / "img.png"))


def _fetch(url: str, allowed: Path) -> bytes | Path:
    async def go():
        async with MediaFetcher(MediaPolicy(allowed_local_media_path=allowed, max_bytes=1000)) as f:
            return await f.fetch(url)

    return asyncio.run(go())


def _content(fetched: bytes | Path) -> bytes:
    return fetched.read_bytes() if isinstance(fetched, Path) else fetched


def test_local_media_in_a_folder_swapped_for_a_symlink_after_the_check_is_refused(tree, monkeypatch):
    """The folder holding the picture is swapped for a symlink out of the allowed folder right after the path was
    resolved and checked: nothing of outside is read (the picture itself comes back as bytes, read once)."""
    allowed, outside = tree
    assert _content(_fetch(f"file://{allowed}/sub/img.png", allowed)) == PICTURE
    real_realpath = os.path.realpath

    def resolve_then_swap(path, *args, **kwargs):
        resolved = real_realpath(path, *args, **kwargs)
        if str(path).endswith("img.png") and not (allowed / "sub-kept").exists():
            _swap(allowed, outside)
        return resolved

    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    fetched = None
    with pytest.raises(MediaFetchError, match="does not exist or cannot be read"):
        fetched = _content(_fetch(f"file://{allowed}/sub/img.png", allowed))
    assert fetched != SECRET and (allowed / "sub-kept").exists()
