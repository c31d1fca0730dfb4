"""A prefill instance's KV row writes, seen from its front end: the engine process keeps a finished prefill's KV
rows and writes them into a decode instance's blocks itself (kv_connector.PrefillConnector with a row writer);
the front end, which runs the transfer's protocol, asks for each chunk and awaits its end here. No KV byte passes
through this process."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from vlserve.core.errors import EngineDeadError, VlserveError
from vlserve.core.wire import FinishRequests, KVWritten, WriteKV


class KVWriteFailed(VlserveError):
    """The engine could not write a chunk's rows (the receiver gone, a bad address, ...): that transfer fails."""


class KVWrites:
    def __init__(self, send: Callable[[object], None]):
        self._send = send  # to the engine process
        self._ids = itertools.count()
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}

    async def write(self, request_id: str, start: int, end: int, destination: bytes) -> int:
        """Rows of tokens [start, end) of the engine's kept request `request_id` (its states too when `end` is its
        last token) written to `destination`; returns the bytes written. Cancelling waits for nothing: the engine
        finishes the write (who cancels must still wait for it before reusing the blocks: see the sender)."""
        write_id = next(self._ids)
        future = self._waiting[(request_id, write_id)] = asyncio.get_running_loop().create_future()
        try:
            self._send(WriteKV(request_id, write_id, start, end, destination))
            return await future
        finally:
            self._waiting.pop((request_id, write_id), None)

    def release(self, request_id: str) -> None:
        """The transfer is over: the engine drops the request's kept rows."""
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
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine stopped: {reason}"))
        self._waiting.clear()
