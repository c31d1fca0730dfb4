"""KV blocks a decode engine reserved for peers' writes (its KV cache in a shared file): each reservation is held
under a holder name (one transfer, named by the front end) until a queued request claims the run it arrived with
and takes it when the scheduler admits it, or the holder's release gives back what no request claimed. A holder's
blocks take peers' writes under its name (`grants`, checked by the row socket) until claimed or released."""

from __future__ import annotations

from vlserve.core.errors import InvalidInputError
from vlserve.engine.block_pool import BlockPool
from vlserve.engine.write_grants import WriteGrants


class ReservedBlocks:
    def __init__(self, pool: BlockPool, block_size: int, grants: WriteGrants | None = None):
        self.pool, self.block_size = pool, block_size
        self.grants = grants if grants is not None else WriteGrants()
        self._held: dict[str, list[int]] = {}  # holder -> its blocks, in the order they were reserved
        self._holder_of: dict[int, str] = {}  # block -> its holder
        self._claims: dict[str, tuple[str, list[int]]] = {}  # queued request -> (holder, the run it will take)
        self._claimed: set[int] = set()  # every block of those runs

    @property
    def has_claims(self) -> bool:
        """A queued request waits to take a run it claimed."""
        return bool(self._claims)

    def reserve(self, holder: str, num_blocks: int) -> list[int]:
        """`num_blocks` more for `holder` (the caller checked the pool has them)."""
        blocks = self.pool.allocate(num_blocks)
        self._held.setdefault(holder, []).extend(blocks)
        self._holder_of.update((b, holder) for b in blocks)
        self.grants.open(holder, blocks)
        return blocks

    def release(self, holder: str, block_ids: list[int] | None = None) -> None:
        """`holder`'s blocks (those of `block_ids`; None: all) back to the pool, but for those a queued request
        claimed (they go with it). Nothing for a holder unknown here (released already, or an engine restarted)."""
        held = self._held.get(holder)
        if held is None:
            return
        asked = set(held if block_ids is None else block_ids)
        gone = [b for b in held if b in asked and b not in self._claimed]
        self._drop(holder, gone)
        self.grants.close(gone)  # once no write into them runs: then they may go to another request
        self.pool.free(gone)

    def claim(self, request_id: str, blocks: list[int], rows: int) -> None:
        """A queued request arrived with `blocks` holding `rows` rows: refused unless one holder reserved them all
        and no other request claimed any."""
        self._check(blocks, rows)
        self.grants.close(blocks)  # its transfer is over: no peer writes into them any more
        self._claims[request_id] = (self._holder_of[blocks[0]], blocks)
        self._claimed.update(blocks)

    def _check(self, blocks: list[int], rows: int) -> None:
        holders = {self._holder_of.get(b) for b in blocks}
        if not blocks or None in holders or len(holders) != 1 or len(set(blocks)) != len(blocks) \
                or not self._claimed.isdisjoint(blocks):
            raise InvalidInputError("a handed-over request's KV blocks were not reserved for it here")
        if len(blocks) * self.block_size < rows:
            raise InvalidInputError(f"the handed-over KV blocks do not hold the request's {rows} rows")

    def unclaim(self, request_id: str) -> None:
        """The request left before taking its run: the blocks are their holder's again (its release frees them)."""
        claim = self._claims.pop(request_id, None)
        if claim is not None:
            self._claimed.difference_update(claim[1])

    def take(self, request_id: str) -> list[int]:
        """The request takes its claimed run: from here its blocks are freed with it."""
        holder, blocks = self._claims.pop(request_id)
        self._claimed.difference_update(blocks)
        self._drop(holder, blocks)
        return list(blocks)

    def _drop(self, holder: str, blocks: list[int]) -> None:
        gone = set(blocks)
        left = [b for b in self._held[holder] if b not in gone]
        for b in blocks:
            del self._holder_of[b]
        if left:
            self._held[holder] = left
        else:
            del self._held[holder]

    @property
    def num_blocks(self) -> int:
        return len(self._holder_of)
