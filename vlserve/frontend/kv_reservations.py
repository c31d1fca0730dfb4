"""A decode instance's blocks for peers' writes, seen from its front end: a prefill instance writes a prompt's KV
into blocks the engine reserved for that transfer: of its KV cache when it keeps it in a shared file
(core.config.kv_cache_shared: the request takes them, nothing is copied), else its receive blocks (on a GPU, at
ranks torchrun started: copied into its KV cache at admission). The front end, which runs the transfer's protocol,
reserves runs here and lets go of what no request took; the blocks themselves are the engine's, which also
checks peers' writes against them (engine.write_grants). A reservation the pool is short for waits in the
engine, which answers it as its requests free blocks: nothing here asks again."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from vlserve.core.errors import EngineDeadError, ServiceUnavailableError
from vlserve.core.wire import CancelReserveKV, KVReserved, ReleaseKV, ReserveKV


class KVReservations:
    def __init__(self, send: Callable[[object], None], alive: Callable[[], bool]):
        self._send = send  # to the engine process
        self._alive = alive  # its process is there (a send to a dead one would block for ever)
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[str, asyncio.Future]] = {}
        self._unwanted: dict[int, str] = {}  # reservations whose asker is gone: released when their answer comes

    async def reserve(self, holder: str, num_rows: int) -> list[int]:
        """Blocks for `num_rows` rows under `holder` (one transfer), once the engine has them (cancel to give up).
        ServiceUnavailableError: it never could be."""
        if not self._alive():
            raise EngineDeadError("the engine is gone: no KV blocks can be reserved")
        reserve_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[reserve_id] = (holder, future)
        try:
            self._send(ReserveKV(holder, reserve_id, num_rows))
            answer: KVReserved = await future
        except asyncio.CancelledError:
            # Only what this answer gives goes back: the holder's other blocks may still be written by its peer.
            if self._waiting.pop(reserve_id, None) is not None:
                self._unwanted[reserve_id] = holder  # it has not come yet: it waits no more (or goes back)
                if self._alive():
                    self._send(CancelReserveKV(reserve_id))
            elif future.done() and not future.cancelled() and future.result().block_ids:
                self.release(holder, future.result().block_ids)  # it came just before the cancel
            raise
        finally:
            self._waiting.pop(reserve_id, None)
        if answer.error is not None or answer.block_ids is None:
            raise ServiceUnavailableError(f"the prompt does not fit this server's blocks for peers' writes: "
                                          f"{answer.error or 'none given'}")
        return answer.block_ids

    def release(self, holder: str, block_ids: list[int] | None = None) -> None:
        """`holder`'s reserved blocks (those of `block_ids`; None: all) go back; blocks a request took stay its."""
        if self._alive():
            self._send(ReleaseKV(holder, block_ids))

    def settle(self, answers: list[KVReserved]) -> None:
        for a in answers:
            holder = self._unwanted.pop(a.reserve_id, None)
            if holder is not None:
                if a.block_ids:
                    self.release(holder, a.block_ids)
                continue
            holder, future = self._waiting.pop(a.reserve_id, (None, None))
            if future is not None and not future.done():
                future.set_result(a)

    def fail_all(self, reason: str) -> None:
        """The engine died or stopped answering: its askers fail now; an answer that still comes (an engine
        that answers again) is released."""
        for reserve_id, (holder, future) in self._waiting.items():
            self._unwanted[reserve_id] = holder
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine stopped ({reason}) while reserving KV blocks"))
        self._waiting.clear()
