"""Where a receiving server gets the blocks a peer writes a prompt's rows into, one transfer (a `holder`) at a
time:
- `LocalBlocks`: its own receive buffers (media rows from encoders), allocated here;
- `EngineKVBlocks`: blocks a decode engine reserves for the transfer (frontend.kv_reservations): of its KV cache
  itself (in shared files; the request arriving with them takes them, nothing is copied), or on a GPU (or at ranks
  torchrun started) its receive blocks (copied into its KV cache at admission). Its KV cache the front end knows by its
  layout only (`EngineKVLayout`): it maps none of it.
Either way every block is given back on every path but success, and after success by `handed`'s callback. A
run of blocks takes its peer's writes (under the transfer's grant: engine.write_grants) from its allocation
until its chunk's header comes (`seal`) or it is freed: `LocalBlocks` opens and closes the grants of its buffers
here, a decode engine those of its blocks as it reserves, admits (claims) and releases them (it serves the row
socket)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from vlserve.core.errors import ServiceUnavailableError
from vlserve.engine.transfer_buffers import BlockRows, BufferLayout, TransferBuffers


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
                if self.buffers.grants is not None:
                    self.buffers.grants.open(holder, blocks)
                return blocks
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("the receive buffer stayed full; retry later")
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def seal(self, run: list[int]) -> None:
        """`run`'s chunk came: it takes no more writes (its rows are checked next, then read), though still held."""
        if self.buffers.grants is not None:  # (waits only for a write into it still under way)
            self.buffers.grants.close(run)

    def free(self, holder: str | None, blocks: list[int]) -> None:
        if blocks:
            if self.buffers.grants is not None:  # (waits only for a write into them still under way)
                self.buffers.grants.close(blocks)
            self.buffers.free(blocks)
            self._freed.set()

    def handed(self, holder: str, blocks: list[int]) -> Callable[[], None]:
        """What frees a successful transfer's blocks once the engine is done with its rows (sealed already: the
        engine reads what was checked)."""
        if self.buffers.grants is not None:
            self.buffers.grants.close_grant(holder)
        return lambda: self.free(holder, blocks)


class EngineKVBlocks:
    def __init__(self, reservations, capacity_rows: int):
        self.reservations = reservations  # frontend.kv_reservations.KVReservations
        self.capacity_rows = capacity_rows  # the engine's KV pool (its file has a scratch block more)

    async def allocate(self, holder: str, rows: int, timeout: float) -> list[int]:
        """Asked once: a short pool's engine answers as its requests free blocks."""
        try:
            return await asyncio.wait_for(self.reservations.reserve(holder, rows), max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise ServiceUnavailableError("this server's KV blocks for peers' writes stayed taken; retry "
                                          "later") from None

    def seal(self, run: list[int]) -> None:
        """Nothing here: the grants are the engine's (the process serving the row socket), closed when the request
        arrives there (a round trip per chunk would cost an engine step each). So the front end's check of the
        rows guards against faults, not against the peer, whose writes decide its request's KV anyway."""

    def free(self, holder: str, blocks: list[int]) -> None:
        if blocks:
            self.reservations.release(holder, blocks)

    def handed(self, holder: str, blocks: list[int]) -> Callable[[], None]:
        """The request took its blocks in the engine (they go with it); if it never got there they are still the
        holder's, and go back."""
        return lambda: self.reservations.release(holder)


class EngineKVLayout(BlockRows):
    """A decode engine's KV cache as its front end knows it: the layout the engine registered for peers' writes,
    nothing mapped (what peers write there the engine checks: its row socket, or at admission). Stands in for
    the receive buffers where the front end only checks headers against their layout."""

    restored = 0  # (the file is the engine's: this process never restores it)

    def __init__(self, layout: BufferLayout):
        self.layout = layout

    def restore_file(self) -> bool:
        return False
