"""Small helpers for the processes vlserve starts (standard library only, so any layer may use them)."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys


def die_with_parent() -> None:
    """If the parent is killed outright, this process gets SIGTERM instead of lingering (Linux; a no-op
    elsewhere). Safe as a `preexec_fn`."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port free on loopback right now (the caller binds it at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
