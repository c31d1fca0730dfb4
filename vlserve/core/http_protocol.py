"""How every vlserve HTTP server reads requests: the fastest parser and event loop this machine has, and bounds
on what a client may take (slow-loris connections are closed, not kept).

Parser: httptools (llhttp, C) where installed, else h11 (pure Python); event loop: uvloop where installed, else
asyncio's (VLSERVE_HTTP_PARSER=h11 and VLSERVE_EVENT_LOOP=asyncio force the others). On a 2-core machine
serving one stream, the front end's per-token work (an SSE chunk through uvicorn) competes with the engine's
threads for the same cores: httptools and uvloop took an eighth off it (benchmarks/front_end_cpu.py: 0.66 ->
0.57 ms a token).

Bounds: a request's line and headers must arrive within `header_timeout` seconds (counted from the connection,
or from the end of the previous response on a kept-alive one: uvicorn itself has no such limit, so a client
sending a byte every few seconds would hold a connection for ever), and hold at most HEADER_BYTES bytes (h11's
own bound; llhttp has none: past it the request gets a 431 and the connection is closed). The body's own
deadline is checked where it is read (serving.read_body): a slow body gets a 408.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Coroutine
from typing import Any

from vlserve.core.errors import ConfigurationError

logger = logging.getLogger("vlserve.server")
HEADER_BYTES = 16 * 1024  # a request's line and headers, at most (h11's default bound)
PARSER_ENV, LOOP_ENV = "VLSERVE_HTTP_PARSER", "VLSERVE_EVENT_LOOP"  # a choice to force (benchmarks, a bug)


def _chosen(env: str, fast: str, slow: str) -> str:
    """`fast` when its package imports, unless `env` names `slow` (anything else there is refused)."""
    wanted = os.environ.get(env, "")
    if wanted not in ("", fast, slow):
        raise ConfigurationError(f"{env}={wanted!r}: use {fast} or {slow}")
    if wanted == slow:
        return slow
    try:
        importlib.import_module(fast)
    except ImportError:
        if wanted == fast:
            raise ConfigurationError(f"{env}={fast} but {fast} is not installed") from None
        return slow
    return fast


def parser_name() -> str:
    """"httptools" where it is installed, else "h11" (VLSERVE_HTTP_PARSER forces one)."""
    return _chosen(PARSER_ENV, "httptools", "h11")


def loop_name() -> str:
    """"uvloop" where it is installed, else "asyncio" (VLSERVE_EVENT_LOOP forces one)."""
    return _chosen(LOOP_ENV, "uvloop", "asyncio")


def run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run(main), on uvloop's event loop where `loop_name()` says so."""
    if loop_name() == "asyncio":
        return asyncio.run(main)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def http_protocol(header_timeout: float | None, parser: str | None = None) -> type:
    """A uvicorn protocol class (for uvicorn.Config(http=...)) with the bounds above; `header_timeout` None: no
    time bound (a peer-facing server's own); `parser`: "httptools" or "h11" (default: `parser_name()`)."""
    parser = parser or parser_name()
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = _bounded_httptools(HttpToolsProtocol)
    elif parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"unknown HTTP parser {parser!r}")
    return base if header_timeout is None else _with_header_timer(base, header_timeout, parser)


def _bounded_httptools(base: type) -> type:
    """httptools' protocol, refusing a request whose line and headers pass HEADER_BYTES (h11 bounds them itself).
    Counted twice: the bytes received while a request's headers are awaited (httptools builds a header it has not
    seen the end of in memory, so one endless header line must be cut off as it streams in), and the parsed line
    and headers (a request that arrived whole in one read)."""

    class BoundedHttpTools(base):
        _awaiting_headers = True  # from the connection, and after each request, until its headers are complete
        _received = 0  # bytes received while awaiting them
        _parsed = 0  # bytes of its line and headers parsed
        _too_big = False

        def on_message_begin(self) -> None:
            self._parsed = 0
            super().on_message_begin()

        def _count(self, n: int) -> None:
            self._parsed += n
            if self._parsed > HEADER_BYTES:
                self._too_big = True
                raise ValueError("request headers too large")  # stops the parser (HttpParserCallbackError)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._awaiting_headers:  # (not a chunked body's trailers)
                self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._awaiting_headers, self._received = False, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._awaiting_headers = True  # the next request on this connection (pipelined, or kept alive)
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._too_big:
                return  # refused already: the connection is closing
            if self._awaiting_headers:
                self._received += len(data)
            super().data_received(data)
            if self._awaiting_headers and self._received > HEADER_BYTES and not self.transport.is_closing():
                self._too_big = True  # still no end of the headers past the bound
                self._refuse_oversized()

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to any parser error, ours included
            if self._too_big:
                self._refuse_oversized()
            else:
                super().send_400_response(msg)

        def _refuse_oversized(self) -> None:
            msg = f"request headers larger than {HEADER_BYTES} bytes"
            logger.info("refused a request from %s: %s", "%s:%d" % self.client if self.client else "?", msg)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                                 b"charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(msg), msg.encode()))
            self.transport.close()

    return BoundedHttpTools


def _with_header_timer(base: type, header_timeout: float, parser: str) -> type:
    class HeaderTimer(base):
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

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # a kept-alive connection's next request gets the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    # The headers of a new request are complete: h11 has parsed them in handle_events (a new cycle began),
    # httptools tells on_headers_complete.
    class H11HeaderTimer(HeaderTimer):
        def handle_events(self) -> None:
            previous = self.cycle
            super().handle_events()
            if self.cycle is not previous and self.cycle is not None:
                self._disarm()

    class HttpToolsHeaderTimer(HeaderTimer):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._disarm()

    return HttpToolsHeaderTimer if parser == "httptools" else H11HeaderTimer
