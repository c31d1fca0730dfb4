"""Where a receiving server gets the blocks a peer writes a prompt's rows into, one transfer (a `holder`) at a
time:
- `LocalBlocks`: its own receive buffers (media rows from encoders; KV rows for a decode engine that copies them
  into its KV cache at admission), allocated here;
- `EngineKVBlocks`: a decode engine's KV cache itself (in a shared file), whose blocks the engine reserves for
  the transfer (frontend.kv_reservations): the request arriving with them takes them, nothing is copied.
Either way every block is given back on every path but success, and after success by `handed`'s callback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from vlserve.core.errors import ServiceUnavailableError
from vlserve.engine.transfer_buffers import TransferBuffers

# A decode engine short of KV blocks is asked again after this, then twice as long each time up to the most (its
# requests free them; many waiting transfers must not flood its loop with asks).
ENGINE_RETRY_S, ENGINE_RETRY_MAX_S = 0.02, 0.5


class LocalBlocks:
    def __init__(self, buffers: TransferBuffers):
        self.buffers = buffers
        self._freed = asyncio.Event()

    @property
    def capacity_rows(self) -> int:
        return self.buffers.num_blocks * self.buffers.block_tokens

    async def allocate(self, holder: str, rows: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                blocks = self.buffers.allocate(rows)
            except ValueError as e:  # more than the whole pool: it never fits
                raise ServiceUnavailableError(f"the prompt does not fit this server's receive buffer: {e}") from None
            if blocks is not None:
                return blocks
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("the receive buffer stayed full; retry later")
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def free(self, holder: str | None, blocks: list[int]) -> None:
        if blocks:
            self.buffers.free(blocks)
            self._freed.set()

    def handed(self, holder: str, blocks: list[int]) -> Callable[[], None]:
        """What frees a successful transfer's blocks once the engine is done with its rows."""
        return lambda: self.free(holder, blocks)


class EngineKVBlocks:
    def __init__(self, reservations, capacity_rows: int):
        self.reservations = reservations  # frontend.kv_reservations.KVReservations
        self.capacity_rows = capacity_rows  # the engine's KV pool (its file has a scratch block more)

    async def allocate(self, holder: str, rows: int, timeout: float) -> list[int]:
        deadline, pause = time.monotonic() + timeout, ENGINE_RETRY_S
        while (blocks := await self.reservations.reserve(holder, rows)) is None:
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("this server's KV cache stayed full; retry later")
            await asyncio.sleep(pause)
            pause = min(2 * pause, ENGINE_RETRY_MAX_S)
        return blocks

    def free(self, holder: str, blocks: list[int]) -> None:
        if blocks:
            self.reservations.release(holder, blocks)

    def handed(self, holder: str, blocks: list[int]) -> Callable[[], None]:
        """The request took its blocks in the engine (they go with it); if it never got there they are still the
        holder's, and go back."""
        return lambda: self.reservations.release(holder)
