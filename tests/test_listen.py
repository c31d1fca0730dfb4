"""The listening socket `serve` and `router` bind before anything loads (vlserve/server/listen.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from vlserve.core.errors import VlserveError
from vlserve.server.listen import bind_socket


def test_served_connections_send_small_writes_at_once():
    """Nagle's algorithm off on every accepted connection: with it on, a stream's second chunk waited for the
    client's delayed ACK, ~40 ms of every time to first token on a kept-alive connection."""
    sock = bind_socket("127.0.0.1", 0)

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        def on_connection(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)  # as uvicorn serves a socket it is given
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_taken_port_is_a_clear_error():
    first = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(VlserveError, match="cannot listen on 127.0.0.1"):
            bind_socket("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
