"""A prefill engine's sends: a prompt's KV rows written into the decode instance's blocks from this engine
process as the prompt is computed, instead of after it (vLLM's `save_kv_layer`).

The front end names the receiver's blocks for every row of the prompt with the request (`core.wire.KVSend`:
tokens [0, end) and where they go, opaque here). Each step that computes some of those tokens queues, after each layer with a KV
cache has run (`AttentionMetadata.after_kv_layer`), a write of that layer's keys and values of those tokens on the
connector's writer thread, while the engine computes the next layers. When the request finishes, the tokens no
layer write covered (a prefix from the prefix cache, a restart after a preemption) and a hybrid model's state
rows follow from its kept blocks, and the send is answered (`KVWritten`, its `write_id`) once every write has
ended: the front end then sends the chunk's header. A transport that cannot write some planes of some rows
(zmq) gets the whole prompt at the finish instead, in one write, still without the front end asking.

Writes start only until `not_after` (the front end's deadline: a stuck engine must not write into blocks the
receiver gave up on), the first failure fails the send, and a send released meanwhile (its request aborted)
has its queued writes cancelled and is answered once none runs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vlserve.core.wire import KVSend, KVWritten


class SendFailed(RuntimeError):
    """An earlier write of the send failed, or it was released: nothing more is written for it."""


@dataclass
class LayerSend:
    msg: KVSend
    request_id: str
    by_layer: bool = False  # its layers are written as they are computed (else the whole run at the finish)
    # Tokens [lo, hi) whose every layer was queued for writing, from one run of consecutive steps.
    covered: tuple[int, int] | None = None
    futures: list[Future] = field(default_factory=list)
    counted_from: int = 0  # futures[counted_from:] count in the answer's bytes (what came before is written again)
    finished: bool = False  # its request finished and the rest is queued: answered once the writes have ended
    released: bool = False  # its request left before that: nothing more is written, answered as failed
    error: str | None = None  # the first failure (set on the writer thread, read once its writes are done)

    def computed(self, start: int, end: int) -> tuple[int, int] | None:
        """Tokens [start, end) are computed this step: the part of them inside the send, which its layers'
        writes cover, or None. A step that does not follow the last one (a restart after a preemption) starts
        the covered run afresh: what came before it is written again at the finish."""
        lo, hi = start, min(end, self.msg.end)
        if lo >= hi:
            return None
        if self.covered is not None and self.covered[1] == lo:
            self.covered = (self.covered[0], hi)
        else:
            self.covered = (lo, hi)
        return lo, hi

    def restart(self) -> None:
        """Its request was preempted: every row is written again (what it recomputes layer by layer, the rest at
        the finish), so only the writes from here count in the bytes it reports."""
        self.covered = None
        self.counted_from = len(self.futures)

    def rest(self) -> list[tuple[int, int]]:
        """Token ranges of the send that no layer write covered, written whole at the finish."""
        end = self.msg.end
        if self.covered is None:
            return [(0, end)]
        lo, hi = self.covered
        return [r for r in ((0, lo), (hi, end)) if r[0] < r[1]]

    def check_live(self) -> None:
        """On the writer thread, before each write."""
        if self.released:
            raise SendFailed("released before it was written")
        if self.error is not None:
            raise SendFailed(self.error)
        if time.time() > self.msg.not_after:
            raise SendFailed("its deadline passed before the write started (a slow or stuck engine)")

    @property
    def writing(self) -> bool:
        return any(not f.done() for f in self.futures)

    def release(self) -> None:
        self.released = True
        for f in self.futures:
            f.cancel()  # not started yet: it never will

    def answer(self) -> KVWritten | None:
        """Its answer once it is over (finished or released, no write under way), else None."""
        if not (self.finished or self.released) or self.writing:
            return None
        nbytes, error = 0, self.error
        for i, f in enumerate(self.futures):
            if f.cancelled():
                error = error or "released before it was written"
            elif f.exception() is not None:
                error = error or f"{type(f.exception()).__name__}: {f.exception()}"
            elif i >= self.counted_from:
                nbytes += f.result()
        if self.released and error is None:
            error = "released before it was written"
        return KVWritten(self.request_id, self.msg.write_id, 0 if error else nbytes, error)
