"""Private folders for what our own processes share on one machine (their Unix sockets): made 0700, so no other
user can even connect to a socket inside; named by the owner's pid and locked (flock) by it while it lives;
removed when it stops, and swept at the next start after a crash (a SIGKILL leaves them behind).

A folder is swept only when it is this user's, its pid is not a live process here, and its lock is free: the
lock also keeps the folder of a live owner in another PID namespace that shares the parent folder (standard
library only, so any layer may use it). A folder is made under a hidden name (`.`prefix...) the sweep leaves
alone while it is new, locked, and only then renamed: a sweeper in another namespace never sees it unlocked.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
import weakref

MAX_PARENT_CHARS = 60  # a Unix socket's path fits in 107 bytes: the parent, the folder's name and the socket's
HALF_MADE_AGE_S = 60.0  # a hidden folder (or transfer file) this old was left by a crash between its making and its naming


def runtime_dir() -> str:
    """Where private folders go: $XDG_RUNTIME_DIR (this user's own) when set, else the temporary folder; /tmp
    when that path would be too long for a socket's."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    for folder in (xdg, tempfile.gettempdir()):
        if folder and len(folder) <= MAX_PARENT_CHARS and os.path.isdir(folder) and os.access(folder, os.W_OK):
            if folder != xdg or os.stat(folder).st_uid == os.getuid():
                return folder
    return "/tmp"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs here (another user's counts; a zombie, dead but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: the signal test is all we have


def sweep_dead_dirs(parent: str, prefix: str) -> list[str]:
    """Removes `parent`/`prefix`<pid>-* folders of this user whose owner is gone (see the module's note); returns
    their paths."""
    swept = []
    try:
        names = os.listdir(parent)
    except OSError:
        return swept
    for name in names:
        half_made = name.startswith("." + prefix)
        rest = name[len(prefix) + 1:] if half_made else name[len(prefix):] if name.startswith(prefix) else ""
        pid = rest.partition("-")[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
                continue
            if half_made and time.time() - info.st_mtime < HALF_MADE_AGE_S:
                continue  # maybe being made right now (its owner locks, then renames it)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # locked: its owner lives (in another PID namespace)
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
        finally:
            os.close(fd)
    return swept


class PrivateDir:
    """A new private folder `prefix`<pid>-XXXXXXXX under `parent` (default: runtime_dir()), made after sweeping
    the dead owners' ones. Removed by `remove()`, else when this process exits normally."""

    def __init__(self, prefix: str, parent: str | None = None):
        parent = parent or runtime_dir()
        sweep_dead_dirs(parent, prefix)
        while True:
            made = tempfile.mkdtemp(prefix=f".{prefix}{os.getpid()}-", dir=parent)  # mode 0700; hidden: not swept
            fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by the processes we start
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives: the folder is not stale
            self.path = os.path.join(parent, os.path.basename(made)[1:])
            try:
                os.rename(made, self.path)  # the lock follows the folder
                break
            except OSError:  # that name is taken (by a folder with files): another name
                os.close(fd)
                os.rmdir(made)
        self._finalizer = weakref.finalize(self, _remove, self.path, fd, os.getpid())

    def remove(self) -> None:
        self._finalizer()


def _remove(path: str, fd: int, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked child exiting: the folder is its parent's
    os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
