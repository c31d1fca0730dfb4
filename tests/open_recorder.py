"""Which files a test's code opens, whichever way it opens them: by path (open(), os.open without dir_fd: an audit
hook sees those) or by a name relative to a folder's descriptor (os.open(name, dir_fd=fd): the hook sees only the
name, so os.open is wrapped while recording and resolves the folder through /proc/self/fd)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, str], None]  # (the opened path, the name of the thread that opened it)
_listeners: list[Listener] = []
_hooked = False


def _tell(path: str) -> None:
    thread = threading.current_thread().name
    for listener in list(_listeners):
        listener(path, thread)


def _audit(event: str, args: tuple) -> None:
    # a hook cannot be removed: it does nothing unless a test records (and skips relative names: os.open's wrapper
    # below resolves those)
    if _listeners and event == "open" and isinstance(args[0], (str, bytes)) and os.path.isabs(args[0]):
        _tell(os.fsdecode(args[0]))


@contextmanager
def recording_opens(listener: Listener) -> Iterator[None]:
    """Calls listener(path, thread) for every file opened in this process (any thread) while the block runs."""
    global _hooked
    if not _hooked:  # installed once, the first time a test records
        sys.addaudithook(_audit)
        _hooked = True
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *, dir_fd=None):
        if _listeners and isinstance(path, (str, bytes)) and not os.path.isabs(path):
            where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
            _tell(os.path.join(where, os.fsdecode(path)))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    _listeners.append(listener)
    os.open = recording_open
    try:
        yield
    finally:
        os.open = real_open
        _listeners.remove(listener)
