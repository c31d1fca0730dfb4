"""Small helpers for the processes vlserve starts (standard library only, so any layer may use them)."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import logging
import os
import random
import signal
import socket
import sys

LOG_TAG_ENV = "VLSERVE_LOG_TAG"  # `serve --disagg` names each role's lines (and its engine process's) with it


DEPLOYMENT_STATE_ENV = "VLSERVE_DEPLOYMENT_STATE"  # `serve --disagg`: a file naming the roles that keep crashing


def write_degraded(path: str, problems: list[str]) -> None:
    """The supervisor's side: one line per role in trouble, replaced atomically (readers never see half)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(problems))
    os.replace(tmp, path)


def read_degraded() -> list[str]:
    """An API role's side, for /ready: what the supervisor reported (nothing outside `serve --disagg`)."""
    path = os.environ.get(DEPLOYMENT_STATE_ENV)
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            return [line for line in f.read(65536).splitlines() if line]
    except OSError:
        return []


def log_format() -> str:
    """Every vlserve process logs with this format; under `serve --disagg` each line says which role wrote it."""
    tag = os.environ.get(LOG_TAG_ENV, "").replace("%", "%%")
    return "%(asctime)s %(levelname)s " + (f"[{tag}] " if tag else "") + "%(name)s: %(message)s"


def freeze_startup_heap() -> None:
    """Once a process has started (imports, model, tokenizer): the objects alive now leave the garbage
    collector's view. Later collections scan only what requests create (shorter pauses between steps), and the
    exit skips a full collection of the start-up heap (about half a second a process)."""
    gc.freeze()


def die_with_parent() -> None:
    """If the parent is killed outright, this process gets SIGTERM instead of lingering (Linux; a no-op
    elsewhere). Safe as a `preexec_fn`."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


ENGINE_PROCESS_NAME = "vlserve-engine"


def name_process(name: str) -> None:
    """The name `ps -o comm`, `top` and /proc/PID/comm show for this process (at most 15 bytes; Linux only): a
    forked engine process's command line is its front end's, so the name is what tells them apart."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _ephemeral_ports() -> range:
    """The ports the kernel hands out for a bind to port 0 or an outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=1024)  # free_port's recent answers, in order


def free_port() -> int:
    """A TCP port free on loopback right now, for a process that binds it soon after. Picked at random outside
    the kernel's ephemeral range: a port the kernel picked would go back to its pool once this check closes it, and
    any bind to port 0 or outgoing connection meanwhile (a transport library's listener, a gloo rank) may be handed
    the same number before its owner binds it. Never one of its last 1,024 answers: several ports asked for
    one after another (a role's HTTP and data ports) are all still free until their process starts."""
    ephemeral, rng = _ephemeral_ports(), random.SystemRandom()
    below = range(max(1024, ephemeral.start - 12000), ephemeral.start)
    above = range(ephemeral.stop, 65536)
    pool = below if len(below) >= len(above) else above
    for _ in range(64 if len(pool) > 100 else 0):
        port = rng.choice(pool)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.append(port)
            return port
    with socket.socket() as s:  # no room outside the ephemeral range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SigtermStop:
    """A server's life under `with SigtermStop() as sigterm:` (inside its task). During start-up, SIGTERM cancels
    that task instead of ending the process on the spot: its `finally` blocks stop what it started (an engine
    process loading a model, receive-buffer files), and the `with` ends quietly, the code after it running.
    Once `serving()`, a SIGTERM is only noted: uvicorn stops on it, and its re-raise of the signal after stopping
    must not cut the shutdown short."""

    def __init__(self):
        self.received = False
        self._serving = False

    def __enter__(self) -> "SigtermStop":
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_sigterm() -> None:
            self.received = True
            if not self._serving:
                task.cancel()

        self._loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        return self

    def serving(self) -> None:
        self._serving = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._loop.remove_signal_handler(signal.SIGTERM)
        if exc_type is asyncio.CancelledError and self.received and not self._serving:
            logging.getLogger("vlserve").info("SIGTERM during start-up: stopped")
            return True
        return False


async def finish(awaitable):
    """Awaits `awaitable` to its end even if the caller is cancelled meanwhile (a shutdown must not stop half
    way, a copy into shared blocks must land before they are freed); then re-raises the cancellation."""
    work = asyncio.ensure_future(awaitable)
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait([work])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not work.cancelled():
            work.exception()  # the caller is gone: its failure is nobody's to report
        raise asyncio.CancelledError()
    return work.result()
