"""The engine process, forked from a copy of the front end taken before the front end did any work.

A spawned engine process is a fresh interpreter that imports torch and transformers again: ~1.3 CPU-seconds
of every server's start, on a 2-core machine about a second of its wall time too. A front end that forks itself
once it has imported them, but before it starts a thread or runs a torch kernel, gets a child that has them
already: the zygote. It imports the engine's own modules while the front end loads the tokenizer, then waits on
a pipe for the engine's entry and arguments, and becomes the engine process when EngineCoreClient starts one.

Forking at any later point is not safe: a process that has run an OpenMP parallel region (any torch op on a
big enough tensor) hangs in its forked child's first one, and threads (zmq's, the media pool, asyncio's
executor) do not exist in a forked child. So `prefork()` declines where torch was imported before it (something
may have run), where a Python thread runs, off Linux, or with VLSERVE_ENGINE_START=spawn; the engine is then
spawned as before. A zygote serves one start (a front end starts one engine; a second would be spawned).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence

from vlserve.core.processes import die_with_parent, name_process

logger = logging.getLogger("vlserve.engine")

START_METHOD_ENV = "VLSERVE_ENGINE_START"  # "spawn": every engine process is a fresh interpreter
ZYGOTE_PROCESS_NAME = "vlserve-zygote"
ENGINE_MODULES = ("vlserve.engine.core_process",)  # what an engine process imports before its model

_zygote: tuple[multiprocessing.Process, object] | None = None  # (the waiting child, the pipe's sending end)


def unsafe_reason() -> str | None:
    """Why this process cannot fork an engine now, or None."""
    if sys.platform != "linux":
        return "not Linux"
    if os.environ.get(START_METHOD_ENV, "fork") == "spawn":
        return f"{START_METHOD_ENV}=spawn"
    if "torch" in sys.modules:
        return "torch was imported before (a kernel may have run: OpenMP does not survive a fork)"
    if threading.active_count() > 1:  # (native threads are not seen: numpy's OpenBLAS pool handles a fork)
        return "a thread runs"
    return None


def prefork(imports: Sequence[str], close: Iterable = (), warm: Sequence[str] = ENGINE_MODULES) -> bool:
    """Imports `imports` (what this front end imports anyway: torch and transformers among them), then forks the
    zygote. `close`: sockets (or file descriptors) of the front end that the engine must not hold open, such as
    its listening socket. `warm`: modules the zygote imports while it waits. False (nothing forked, the
    modules not imported) where forking is not safe; the engine is spawned then."""
    global _zygote
    if _zygote is not None:
        return True
    why = unsafe_reason()
    if why is not None:
        logger.debug("engine process: spawned, not forked (%s)", why)
        return False
    for name in imports:
        importlib.import_module(name)
    if threading.active_count() > 1:  # an import started one
        logger.debug("engine process: spawned, not forked (an import started a thread)")
        return False
    ctx = multiprocessing.get_context("fork")
    receiving, sending = ctx.Pipe(duplex=False)
    fds = [c if isinstance(c, int) else c.fileno() for c in close]
    proc = ctx.Process(target=_wait_for_engine, args=(receiving, sending, fds, os.getpid(), tuple(warm)),
                       name="vlserve-engine-core", daemon=True)
    proc.start()
    receiving.close()
    _zygote = (proc, sending)
    return True


def start_process(target: Callable, args: tuple, name: str) -> multiprocessing.Process:
    """A started process running `target(*args)`: the zygote where there is one, else a spawned interpreter."""
    global _zygote
    if _zygote is not None:
        proc, sending = _zygote
        _zygote = None
        try:
            sending.send((target, args))
            return proc
        except (BrokenPipeError, OSError) as e:  # it died meanwhile (killed): a fresh one then
            logger.warning("the forked engine process is gone (%s): spawning one", e)
            proc.join(1)
        finally:
            sending.close()
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
    proc.start()
    return proc


def _wait_for_engine(receiving, sending, close_fds: list[int], parent_pid: int, warm: tuple[str, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops the engine in order
    die_with_parent()
    name_process(ZYGOTE_PROCESS_NAME)  # until it is the engine (`ps` tells a waiting one from a running one)
    sending.close()  # this copy would keep the pipe open: the front end's exit must read as its end
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the front end died before die_with_parent took effect
        return
    for name in warm:
        importlib.import_module(name)
    try:
        target, args = receiving.recv()
    except (EOFError, OSError):  # the front end ended without starting an engine
        return
    finally:
        receiving.close()
    try:
        target(*args)
    finally:  # a forked child ends with os._exit: run what a spawned one's exit runs (KV files, ranks' stop)
        atexit._run_exitfuncs()
