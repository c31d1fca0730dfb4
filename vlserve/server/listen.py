"""The listening socket, bound before anything heavy is imported or started: a taken port is reported at once."""

from __future__ import annotations

import socket

from vlserve.core.errors import VlserveError


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port is an error before anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose socket
    # says TCP, and with it on, each streamed chunk after the first waited for the client's delayed ACK (~40 ms of
    # every time to first token on a kept-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise VlserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
