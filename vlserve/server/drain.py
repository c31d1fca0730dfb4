"""A graceful stop (SIGINT / SIGTERM) of an HTTP server: `vlserve serve`, `language`, `decode` and `router`.

On the first signal the server drains: new requests get 503 (OpenAI error JSON, `Connection: close`), /ready
answers 503 so that load balancers stop sending, /health, /metrics and /version still answer, and the requests in
flight run on for up to --shutdown-timeout seconds. Then what still runs is cut: a stream that has started ends
with its API's error event (chat and completions: `data: {"error": ...}` then `data: [DONE]`; Responses: `error`
then `response.failed`), an answer not started yet is a 503. A second signal cuts at once. Only then is uvicorn
told to exit: nothing is left for it to cancel (its cancellations were the "Exception in ASGI application"
tracebacks), and the caller shuts its engine down after it. The signal is not raised again afterwards: exit code 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from vlserve.core.errors import ServiceUnavailableError
from vlserve.server.errors import error_response

logger = logging.getLogger("vlserve.server")
ALIVE_PATHS = frozenset({"/health", "/metrics", "/version"})  # answered while draining: the process is alive
READY_PATH = "/ready"
CUT_GRACE_S = 2.0  # for cut responses to send their last events; one whose client does not read is then cancelled
UVICORN_BACKSTOP_S = 2.0  # uvicorn's own graceful timeout: after a drain nothing is left for it to wait for
STOPPING = "the server is shutting down"


class ShuttingDownError(ServiceUnavailableError):
    """A request cut by the server's stop."""


class _Flight:
    """One request in flight: its task (the app's handling of it), whether its answer has started."""

    __slots__ = ("task", "started")

    def __init__(self):
        self.task: asyncio.Task | None = None
        self.started = False


class Drain:
    """The stop of one server. `on_cut(message)` ends what the server runs itself (an engine's requests: their
    streams then send their error events, waiting answers become 503s)."""

    def __init__(self, timeout: float, on_cut: Callable[[str], None] | None = None):
        self.timeout, self.on_cut = timeout, on_cut
        self.stopping = False  # new requests are refused
        self.cutting = False  # what is in flight must end now
        self.message = STOPPING
        self._why = ""
        self._flights: set[_Flight] = set()
        self._interruptible: set[_Interruptible] = set()
        self._asked, self._forced, self._idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._hurry = asyncio.Event()  # a signal during the cut: what does not end by itself is given up now

    def request_stop(self, why: str, force: bool = False) -> None:
        """The first call starts the drain; a second one (another signal), or `force`, cuts what is in flight."""
        if self._asked.is_set() or force:
            self._forced.set()
        if self.cutting:
            self._hurry.set()
        if not self._asked.is_set():
            self._why = why
            self._asked.set()
        self.stopping = True
        self._check_idle()

    async def run(self, http) -> None:
        """Waits for a stop, drains, then tells uvicorn (`http`) to exit."""
        await self._asked.wait()
        try:
            if self._flights and not self._forced.is_set() and self.timeout > 0:
                logger.info("%s: stopping; new requests get 503; waiting up to %gs (--shutdown-timeout) for %d "
                            "request(s) in flight (a second signal ends them now)", self._why, self.timeout,
                            len(self._flights))
                await self._until_idle(self.timeout, self._forced)
                if self._flights and not self._forced.is_set():
                    self.message = (f"{STOPPING}: the request did not finish within --shutdown-timeout "
                                    f"({self.timeout:g}s)")
            if self._flights:
                logger.info("%s: ending %d request(s) in flight", self._why, len(self._flights))
                self.cut()
                await self._until_idle(CUT_GRACE_S, self._hurry)
            if self._flights:  # answers whose clients do not read them: given up
                for flight in list(self._flights):
                    flight.task.cancel()
                await self._until_idle(CUT_GRACE_S)
        finally:
            http.should_exit = True

    def cut(self) -> None:
        self.cutting = True
        if self.on_cut is not None:
            self.on_cut(self.message)
        for block in list(self._interruptible):
            block.interrupt()
        for flight in list(self._flights):
            if not flight.started:  # nothing sent yet: the gate answers 503 instead
                flight.task.cancel()

    def interruptible(self) -> "_Interruptible":
        """`async with drain.interruptible():` a wait that the cut ends with ShuttingDownError (as asyncio.timeout
        ends one with TimeoutError): a relayed stream waiting for its next chunk."""
        return _Interruptible(self)

    def _add(self, flight: _Flight) -> None:
        self._flights.add(flight)
        self._idle.clear()

    def _remove(self, flight: _Flight) -> None:
        self._flights.discard(flight)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._flights:
            self._idle.set()

    async def _until_idle(self, timeout: float, *also: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (self._idle, *also)]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


class _Interruptible:
    def __init__(self, drain: Drain):
        self.drain = drain
        self.task: asyncio.Task | None = None
        self.interrupted = False

    async def __aenter__(self) -> "_Interruptible":
        if self.drain.cutting:
            raise ShuttingDownError(self.drain.message)
        self.task = asyncio.current_task()
        self.drain._interruptible.add(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.drain._interruptible.discard(self)
        if self.interrupted and self.task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            raise ShuttingDownError(self.drain.message) from None

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.task.cancel()


def _refusal(message: str):
    response = error_response(message, 503)
    response.headers["connection"] = "close"
    return response


class DrainGate:
    """ASGI middleware: counts the requests in flight for the drain, refuses new ones while it runs and answers
    503 for one it cancels before its answer started."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.stopping and scope["path"] not in ALIVE_PATHS:
            ready = scope["path"] == READY_PATH
            await _refusal(f"not ready: {STOPPING}" if ready else f"{STOPPING}: it takes no new requests")(
                scope, receive, send)
            return
        flight = _Flight()

        async def tracked_send(message) -> None:
            if message["type"] == "http.response.start":
                flight.started = True
            await send(message)

        # Its own task, so that the drain can cancel it alone; a cancellation of this one reaches it too.
        flight.task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        self.drain._add(flight)
        try:
            await flight.task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # uvicorn's, not the drain's
            if not flight.started:
                await _refusal(self.drain.message)(scope, receive, send)
        finally:
            self.drain._remove(flight)


def graceful_server(config, drain: Drain):
    """A uvicorn server whose SIGINT / SIGTERM start `drain` (which then tells it to exit) instead of stopping it."""
    import uvicorn

    loop = asyncio.get_running_loop()

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # a signal handler: the work is done on the loop
            loop.call_soon_threadsafe(drain.request_stop, signal.Signals(sig).name)

    return GracefulServer(config)
