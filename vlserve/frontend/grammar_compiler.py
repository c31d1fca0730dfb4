"""The HTTP front end's check of a request's constraint (schema, regex, choice, grammar) before it is queued.

Compiles run on their own `GrammarLimits.threads` threads, never on the media pool, so pictures keep being
decoded while grammars compile. At most `threads + max_queued` compiles are in flight, counting those whose
clients left and that still run (a thread cannot be interrupted; every compile ends within its limits): more
get 503 at once. A request waits `compile_timeout` for a thread (503 after that) and as long again for its
compile (400, naming the field); one whose client leaves stops waiting, and its compile, if not started, never
runs. Outcomes are kept by spec (an LRU by bytes), so a spec compiled or refused once is answered at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from vlserve.core.errors import ServiceUnavailableError
from vlserve.core.structured_outputs import GrammarLimits, StructuredOutputsError, StructuredOutputsParams
from vlserve.engine.structured.cache import ByteLRU, spec_digest
from vlserve.engine.structured.grammar import cacheable, grammar_for
from vlserve.engine.structured.pool import CompilePool

_UNKNOWN = object()
GRACE_S = 0.5  # the compile thread notices its own overrun first and keeps that outcome for the next request


class _Job:
    started: float | None = None


class GrammarCompiler:
    def __init__(self, limits: GrammarLimits):
        self.limits = limits
        self._pool = CompilePool(limits.threads, "vlserve-grammar-check")
        self._outcomes = ByteLRU(limits.cache_mb << 20)  # spec digest -> None (compiles) | StructuredOutputsError
        self._lock = threading.Lock()
        self.in_flight = 0  # queued or running, abandoned ones included until they end

    async def check(self, spec: StructuredOutputsParams) -> None:
        """Returns once `spec` compiles; StructuredOutputsError (400) if it cannot or takes too long,
        ServiceUnavailableError (503) if no compile thread is free soon enough."""
        digest = spec_digest(spec.key)
        known = self._outcomes.get(digest, _UNKNOWN)
        if known is not _UNKNOWN:
            if known is not None:
                raise known.for_field(known.field)
            return
        job = _Job()
        waiting = asyncio.wrap_future(self._submit(spec, digest, job))  # cancelling it cancels a queued compile
        timeout = self.limits.compile_timeout
        deadline, compiling = time.monotonic() + timeout, False
        try:
            while True:
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                        await asyncio.shield(waiting)  # a timeout here must not cancel it: it may get more time
                    return
                except TimeoutError:
                    if job.started is None:
                        raise ServiceUnavailableError(f"every structured-outputs compile thread has been busy for "
                                                      f"{timeout:g}s; retry later") from None
                    if compiling:
                        raise StructuredOutputsError(spec.kind, f"took longer than {timeout:g}s to compile "
                                                     "(--structured-outputs-compile-timeout)") from None
                    deadline, compiling = job.started + timeout + GRACE_S, True
        finally:
            waiting.cancel()

    def _submit(self, spec: StructuredOutputsParams, digest: bytes, job: _Job) -> Future:
        with self._lock:
            if self.in_flight >= self.limits.threads + self.limits.max_queued:
                raise ServiceUnavailableError(
                    f"{self.in_flight} structured-outputs constraints are being compiled or wait for it "
                    f"(--structured-outputs-threads, --structured-outputs-max-queued); retry later")
            self.in_flight += 1
        try:
            future = self._pool.submit(self._compile, spec, digest, job)
        except RuntimeError:  # shut down
            self._done(None)
            raise ServiceUnavailableError("the server is shutting down") from None
        future.add_done_callback(self._done)
        return future

    def _done(self, _future) -> None:
        with self._lock:
            self.in_flight -= 1

    def _compile(self, spec: StructuredOutputsParams, digest: bytes, job: _Job) -> None:
        job.started = time.monotonic()
        try:
            grammar_for(spec, self.limits)
        except StructuredOutputsError as e:
            kept = cacheable(e)
            if kept is not None:
                self._outcomes.put(digest, kept, len(str(e)))
            raise
        self._outcomes.put(digest, None, 0)

    def shutdown(self) -> None:
        self._pool.shutdown()
