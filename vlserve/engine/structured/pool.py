"""The threads constraints compile on: a fixed few, each with a large stack.

The grammar engine compiles rules, terminals and `$ref`s by recursion: a chain of 3000 Lark rules, 500 rules
nested 20 parentheses deep or a JSON schema of 1000 chained `$defs` (100 KB) overflows a default 8 MiB thread
stack, and the process dies of a segmentation fault. Within the limits (`max_rules` rules, 30 nesting levels
each, 1 MiB of spec) the deepest measured needs between 128 and 256 MiB; the stack is address space, only
the pages a compile touches are ever backed by memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

COMPILE_STACK_BYTES = 256 << 20
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it only around our starts


class CompilePool:
    """`threads` daemon threads taking jobs in order. A job whose future is cancelled before it starts never
    runs (`Future.cancel`); `shutdown` cancels the jobs not started."""

    def __init__(self, threads: int, name: str, stack_bytes: int = COMPILE_STACK_BYTES):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        with _STACK_SIZE_LOCK:
            before = threading.stack_size(stack_bytes)
            try:
                for thread in self._threads:
                    thread.start()
            finally:
                threading.stack_size(before)

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError("the compile pool is shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(e)

    def shutdown(self) -> None:
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
