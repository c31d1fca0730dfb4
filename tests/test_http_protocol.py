"""The HTTP protocol every vlserve server runs (vlserve/core/http_protocol.py): httptools or h11, each with the
header deadline and, for httptools, the header size bound; the event loop and parser choice by environment."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from vlserve.core import http_protocol
from vlserve.core.errors import ConfigurationError
from vlserve.core.processes import free_port

PARSERS = ["httptools", "h11"]


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/x")
    async def x():
        return {"ok": 1}

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture(params=PARSERS)
def server(request):
    port = free_port()
    config = uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning", log_config=None,
                            http=http_protocol.http_protocol(0.5, request.param))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: http_protocol.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port, request.param
    srv.should_exit = True
    thread.join(5)


def _exchange(port: int, data: bytes, timeout: float = 3.0) -> tuple[bytes, float]:
    """What the server answers to `data` until it closes the connection, and when it closed (s)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(data)
        conn.settimeout(timeout)
        out = b""
        try:
            while chunk := conn.recv(65536):
                out += chunk
        except socket.timeout:
            out += b"<still open>"
    return out, time.monotonic() - start


def test_requests_and_streams_are_answered(server):
    port, _ = server
    out, _ = _exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b'{"ok":1}')
    out, _ = _exchange(port, b"GET /stream HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert b"data: 0" in out and b"data: 2" in out and out.endswith(b"0\r\n\r\n")


def test_headers_slower_than_the_deadline_close_the_connection(server):
    port, _ = server
    out, took = _exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\n")  # never finished
    assert out == b"" and 0.4 < took < 2.5


def test_a_kept_alive_connection_gets_the_deadline_again_after_its_response(server):
    port, _ = server
    out, took = _exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")  # kept alive, then nothing more
    assert out.startswith(b"HTTP/1.1 200") and 0.4 < took < 2.5


def test_oversized_headers_are_refused(server):
    port, parser = server
    big = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (http_protocol.HEADER_BYTES + 10) + b"\r\n\r\n"
    out, _ = _exchange(port, big)
    if parser == "httptools":
        assert out.startswith(b"HTTP/1.1 431") and b"larger than 16384 bytes" in out
    else:  # h11 bounds only what it holds unparsed: sent at once, the request is read
        assert out.startswith(b"HTTP/1.1 ")


def test_an_endless_header_line_is_cut_off_as_it_streams_in(server):
    """httptools keeps a header it has not seen the end of in memory: the bytes awaiting the headers are counted."""
    port, parser = server
    if parser != "httptools":
        pytest.skip("h11 bounds its own buffer")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\nX-Endless: ")
        sent = 0
        try:
            while sent < 4 * http_protocol.HEADER_BYTES:
                conn.sendall(b"a" * 1024)  # never ends the line
                sent += 1024
                time.sleep(0.001)
        except OSError:
            pass  # closed by the server
        conn.settimeout(3)
        out = conn.recv(65536)
    assert out.startswith(b"HTTP/1.1 431")


def test_a_request_under_the_bound_passes(server):
    port, _ = server
    header = b"X-Fit: " + b"a" * (http_protocol.HEADER_BYTES - 200) + b"\r\n"
    out, _ = _exchange(port, b"GET /x HTTP/1.1\r\nHost: a\r\n" + header + b"Connection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200")


def test_the_environment_picks_the_parser_and_loop(monkeypatch):
    monkeypatch.delenv(http_protocol.PARSER_ENV, raising=False)
    monkeypatch.delenv(http_protocol.LOOP_ENV, raising=False)
    assert http_protocol.parser_name() == "httptools" and http_protocol.loop_name() == "uvloop"  # installed

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert http_protocol.run(loop_module()).startswith("uvloop")
    monkeypatch.setenv(http_protocol.PARSER_ENV, "h11")
    monkeypatch.setenv(http_protocol.LOOP_ENV, "asyncio")
    assert http_protocol.parser_name() == "h11" and http_protocol.loop_name() == "asyncio"
    assert http_protocol.run(loop_module()).startswith("asyncio")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert issubclass(http_protocol.http_protocol(None), H11Protocol)
    monkeypatch.setenv(http_protocol.PARSER_ENV, "picohttp")
    with pytest.raises(ConfigurationError, match="VLSERVE_HTTP_PARSER='picohttp'"):
        http_protocol.parser_name()


def test_a_missing_package_falls_back_unless_it_was_asked_for(monkeypatch):
    real = http_protocol.importlib.import_module

    def no_uvloop(name):
        if name == "uvloop":
            raise ImportError(name)
        return real(name)

    monkeypatch.setattr(http_protocol.importlib, "import_module", no_uvloop)
    monkeypatch.delenv(http_protocol.LOOP_ENV, raising=False)
    assert http_protocol.loop_name() == "asyncio"
    monkeypatch.setenv(http_protocol.LOOP_ENV, "uvloop")
    with pytest.raises(ConfigurationError, match="not installed"):
        http_protocol.loop_name()
