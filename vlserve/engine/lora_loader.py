"""LoRA adapters read off the engine loop. A request whose adapter is not in host memory waits here while loader
threads read the adapter's files (once: read, checked, hashed, turned into weights); the engine loop meanwhile
steps every other request. When the read is done the loop hands the weights to the slots and admits the requests
that waited for them, in the order they came; a refused adapter refuses those requests only, each with the same
answer (made once from the error). A request aborted while it waits never starts. Held requests count as waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from vlserve.core.errors import VlserveError
from vlserve.core.lora import AdapterRef
from vlserve.core.sampling_params import fan_out
from vlserve.lora.slots import LoRASlots

logger = logging.getLogger("vlserve.engine")
LOADER_THREADS = 2  # one slow folder leaves a thread for the others


@dataclass
class Waiting:
    ref: AdapterRef
    requests: list = field(default_factory=list)  # (request id, engine ids of its samples, what admits it)


class AdapterLoader:
    def __init__(self, slots: LoRASlots, threads: int = LOADER_THREADS):
        self.slots = slots
        self.waiting: dict[str, Waiting] = {}  # adapter key -> its read under way and the requests waiting for it
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (key, weights or the exception)
        for i in range(threads):  # daemons: a stuck read never holds up the process's exit
            threading.Thread(target=self._work, name=f"vlserve-lora-{i}", daemon=True).start()

    def must_wait(self, ref: AdapterRef | None) -> bool:
        """Whether a new request with this adapter waits here (on the engine thread: the slots are its)."""
        return ref is not None and (ref.key in self.waiting or not self.slots.holds(ref))

    def hold(self, request_id: str, ref: AdapterRef, params, admit) -> None:
        """Keeps the request until its adapter is read; `admit(refusal)` then admits it (refusal None) or refuses
        it with refusal's (message, HTTP status)."""
        engine_ids = frozenset(cid for cid, _ in fan_out(params, request_id))
        waiting = self.waiting.get(ref.key)
        if waiting is None:
            waiting = self.waiting[ref.key] = Waiting(ref)
            self._todo.put(ref)
        waiting.requests.append((request_id, engine_ids, admit))

    def drop(self, engine_ids) -> list:
        """Requests aborted (or stopped) while they wait: they never start. Returns their `admit` callbacks (the
        caller refuses them through it)."""
        gone, ids = [], set(engine_ids)
        for waiting in self.waiting.values():
            kept = []
            for entry in waiting.requests:
                (gone if entry[0] in ids or entry[1] & ids else kept).append(entry)
            waiting.requests = kept
        return [admit for _, _, admit in gone]

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    @property
    def num_held(self) -> int:
        """Engine sequences (a request's samples) waiting here for their adapter."""
        return sum(len(entry[1]) for waiting in self.waiting.values() for entry in waiting.requests)

    def admit_ready(self) -> None:
        """On the engine thread: each adapter read since the last call goes into host memory, then the requests
        that waited for it are admitted (one adapter at a time, so the next one's insert never drops it first)."""
        while True:
            try:
                key, result = self._done.get_nowait()
            except queue.Empty:
                return
            waiting = self.waiting.pop(key)
            error = result if isinstance(result, BaseException) else None
            if error is None:
                try:
                    self.slots.insert(waiting.ref, result)
                except Exception as e:  # noqa: BLE001 - e.g. larger than host memory allows: its requests fail
                    _log_unexpected(e, waiting.ref)
                    error = e
            refusal = None if error is None else refusal_of(error)
            for _, _, admit in waiting.requests:
                admit(refusal)

    def _work(self) -> None:
        while True:
            ref = self._todo.get()
            try:
                result = self.slots.read(ref)
            except Exception as e:  # noqa: BLE001 - the requests waiting for it get the error
                _log_unexpected(e, ref)
                result = e
            self._done.put((ref.key, result))


def refusal_of(error: BaseException) -> tuple[str, int]:
    """(message, HTTP status) for every request that waited for an adapter that could not be had."""
    if isinstance(error, (VlserveError, ValueError)):
        return str(error), getattr(error, "http_status", 400)
    return f"internal error: {type(error).__name__}", 500


def _log_unexpected(error: BaseException, ref: AdapterRef) -> None:
    """Once per failed read, never per request: a refusal of the adapter (ours, said to its requests) needs no
    traceback; anything else does."""
    if not isinstance(error, (VlserveError, ValueError)):
        logger.error("LoRA adapter %r could not be read", ref.name, exc_info=error)
