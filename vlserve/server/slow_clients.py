"""Bounds on how long a client may take to send a request: slow-loris connections are closed, not kept.

uvicorn closes idle keep-alive connections but has no limit on the time a request's headers take to arrive:
a client sending one byte every few seconds holds a connection (and its buffers) for ever. This protocol arms
a timer when a request's first byte is awaited and closes the connection if its headers are not complete in
time. The body's own deadline is checked where it is read (serving.read_body): a slow body gets a 408.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("vlserve.server")


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """An h11 protocol class (for uvicorn.Config(http=...)) that allows `header_timeout` seconds per request's
    headers, counted from the connection (or from the end of the previous response on a kept-alive one)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _too_slow(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                logger.info("closed a connection from %s: its request headers took more than %gs",
                            "%s:%d" % self.client if self.client else "?", header_timeout)
                self.transport.close()

        def handle_events(self) -> None:
            previous = self.cycle
            super().handle_events()
            if self.cycle is not previous and self.cycle is not None:
                self._disarm()  # the headers of a new request are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # a kept-alive connection's next request gets the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
