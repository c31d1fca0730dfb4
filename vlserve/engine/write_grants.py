"""Which blocks of a receiver's buffers a peer may write right now: those reserved for a live transfer, under
that transfer's grant (an unguessable name the receiver made and sent only to the peer it chose). A write that
names another grant, or any block outside its grant's runs (never reserved, released, taken by a request, in
the prefix cache) is refused before a byte lands, whatever the peer says about itself.

Thread-safe: the receiver's allocator opens and closes grants on its own thread (a decode engine's step loop, a
front end's event loop) while the row socket's thread writes. Closing waits for a write into the grant that is
under way (one chunk's copy), so a block is never given to another request while a write into it still runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator


class WriteGrants:
    def __init__(self):
        self._cv = threading.Condition()
        self._grant_of: dict[int, str] = {}  # block -> the grant it is open to
        self._blocks_of: dict[str, set[int]] = {}  # grant -> its open blocks (closing a grant touches only them)
        self._writing: dict[str, int] = {}  # grant -> writes under way

    def open(self, grant: str, blocks: Iterable[int]) -> None:
        """`blocks` (just reserved for one transfer) may be written under `grant` from now on."""
        with self._cv:
            for b in blocks:
                if (before := self._grant_of.get(b)) is not None:
                    self._forget(before, b)
                self._grant_of[b] = grant
                self._blocks_of.setdefault(grant, set()).add(b)

    def close(self, blocks: Iterable[int]) -> None:
        """`blocks` take no more writes (released, or taken by the request); returns once no write into their
        grants is under way."""
        with self._cv:
            grants = set()
            for b in blocks:
                if (g := self._grant_of.pop(b, None)) is not None:
                    self._forget(g, b)
                    grants.add(g)
            self._cv.wait_for(lambda: grants.isdisjoint(self._writing))

    def close_grant(self, grant: str) -> None:
        """Every block of `grant` (its transfer is over)."""
        with self._cv:
            for b in self._blocks_of.pop(grant, ()):
                del self._grant_of[b]
            self._cv.wait_for(lambda: grant not in self._writing)

    def _forget(self, grant: str, block: int) -> None:
        held = self._blocks_of[grant]
        held.discard(block)
        if not held:
            del self._blocks_of[grant]

    @contextlib.contextmanager
    def writing(self, grant: str, blocks: list[int]) -> Iterator[None]:
        """Held while a write into `blocks` runs; ValueError (nothing written) unless all are open to `grant`."""
        with self._cv:
            if not grant or not blocks or any(self._grant_of.get(b) != grant for b in blocks):
                raise ValueError("the write names blocks that are not reserved for its transfer here (never "
                                 "reserved, released, or its transfer is over): nothing written")
            self._writing[grant] = self._writing.get(grant, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                if self._writing[grant] == 1:
                    del self._writing[grant]
                else:
                    self._writing[grant] -= 1
                self._cv.notify_all()

    def __len__(self) -> int:
        """Blocks open to some grant."""
        with self._cv:
            return len(self._grant_of)
