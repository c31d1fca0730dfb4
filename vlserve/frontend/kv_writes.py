"""A prefill instance's KV sends, seen from its front end: the engine process keeps a prompt's KV rows and writes
them into a decode instance's blocks itself, as it computes the prompt (kv_connector.PrefillConnector with a row
writer, told where by the request's `KVSend`); the front end, which runs the transfer's protocol, awaits each
send's end here. No KV byte passes through this process."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from vlserve.core.errors import EngineDeadError, VlserveError
from vlserve.core.wire import FinishRequests, KVWritten


class KVWriteFailed(VlserveError):
    """The engine could not write a send's rows (the receiver gone, a bad address, ...): that transfer fails."""


class KVWriteUnsettled(VlserveError):
    """The engine stopped answering while a send was under way: a write may still start (until its
    `not_after`) and land, so that transfer fails without telling the receiver its blocks are free (its
    quarantine frees them)."""


class KVWrites:
    def __init__(self, send: Callable[[object], None], alive: Callable[[], bool]):
        self._send = send  # to the engine process
        self._alive = alive  # its process is there (a send to a dead one would block for ever)
        self._ids = itertools.count()
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}

    def expect(self, request_id: str) -> tuple[int, asyncio.Future]:
        """A send the engine makes by itself (a `KVSend` sent with the request, carrying this id): its future
        gives the bytes written, or fails (KVWriteFailed; KVWriteUnsettled when the engine stopped answering);
        it settles once the engine answers (or dies). Cancelling waits for nothing: the engine may still write
        (see the sender's abort)."""
        write_id = next(self._ids)
        future = self._waiting[(request_id, write_id)] = asyncio.get_running_loop().create_future()
        return write_id, future

    def release(self, request_id: str) -> None:
        """The transfer is over: the engine drops the request's kept rows (a dead one has nothing to drop)."""
        if self._alive():
            self._send(FinishRequests([request_id], "abort"))

    def settle(self, written: list[KVWritten]) -> None:
        for w in written:
            future = self._waiting.pop((w.request_id, w.write_id), None)
            if future is None or future.done():
                continue  # its caller is gone
            if w.error is None:
                future.set_result(w.nbytes)
            else:
                future.set_exception(KVWriteFailed(f"the KV rows could not be written: {w.error}"))

    def fail_all(self, reason: str) -> None:
        """The engine died or stopped answering: no send's end will be reported."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(KVWriteUnsettled(f"the engine stopped ({reason}) while writing KV rows"))
        self._waiting.clear()
