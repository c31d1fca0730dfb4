"""ZeroMQ sockets between our own processes on one machine (the engine process and its front end, the
tensor-parallel ranks): reachable only by this user, and served only to the processes meant to use them.

- Where: Unix sockets in a private folder (core/private_dirs.py: 0700, swept after a crash), so a process of
  another user cannot connect at all.
- Who: a socket bound here admits only a peer that proves it holds the folder's random token, which the peer
  gets from its parent (multiprocessing's pipe, or the environment: neither is visible to other users). ZeroMQ's
  PLAIN mechanism carries it, checked by a ZAP handler thread of the binding context, before the connection
  carries any message: a second process of this user that connects is refused, never served (a PUSH would
  otherwise hand it every other input message, round-robin). PLAIN costs nothing per message (CURVE would
  encrypt every pixel), and without a running ZAP handler libzmq refuses every PLAIN peer: it fails closed.
- Over TCP (tensor-parallel ranks on several machines), where PLAIN would send the token and every message in
  clear: CURVE, with key pairs derived from the token (core/curve_keys.py), the client's key checked by the same
  handler (and ZAP enforced, so no handler means no peer).

The handler thread sleeps in its socket until a peer connects, and ends when the context terminates.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading

import zmq
from zmq.utils import z85

from vlserve.core.curve_keys import curve_keypair
from vlserve.core.private_dirs import PrivateDir

logger = logging.getLogger("vlserve.engine")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27): one handler per context
USER = b"vlserve"
SERVER_KEYS, CLIENT_KEYS = "vlserve-rank-srv", "vlserve-rank-cli"  # the purposes (<= 16 bytes) of its CURVE pairs


class PrivateSockets:
    """The binding side: a private folder, a token, and the ZAP handler that checks it, all in `ctx`."""

    def __init__(self, ctx: zmq.Context, prefix: str):
        self.token = secrets.token_hex(32)
        self.dir = PrivateDir(prefix)
        self._client_key = z85.decode(curve_keypair(self.token, CLIENT_KEYS)[0])  # as a ZAP request carries it
        self._refused = 0
        zap = ctx.socket(zmq.REP)
        zap.linger = 0
        try:
            zap.bind(ZAP_ENDPOINT)  # before any socket binds: no peer is ever let in unchecked
        except zmq.ZMQError:
            zap.close()
            self.dir.remove()
            raise
        self._thread = threading.Thread(target=self._serve, args=(zap,), name="vlserve-zap", daemon=True)
        self._thread.start()

    @property
    def folder(self) -> str:
        return self.dir.path

    def address(self, name: str) -> str:
        return f"ipc://{self.folder}/{name}"

    def bind_tcp(self, sock: zmq.Socket, name: str) -> int:
        """Guards `sock` with CURVE (its keys from the token: peers that hold it connect with `connect_private`)
        and binds it to a random TCP port of every interface; returns the port."""
        sock.zap_enforce_domain = True  # no handler: no peer (CURVE would otherwise let in any client)
        sock.zap_domain = name.encode()
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve_keypair(self.token, SERVER_KEYS)
        return sock.bind_to_random_port("tcp://*")

    def bind(self, sock: zmq.Socket, name: str) -> str:
        """Binds `sock` at `name` in the folder, serving only peers that offer the token (PLAIN); returns its
        address."""
        sock.plain_server = True
        sock.zap_domain = name.encode()
        sock.bind(self.address(name))
        return self.address(name)

    def _serve(self, zap: zmq.Socket) -> None:
        try:
            while True:
                frames = zap.recv_multipart()  # sleeps until a peer connects: an idle server never wakes up
                ok = admits(frames, self.token, self._client_key)
                if not ok:
                    self._refused += 1
                    if self._refused == 1 or self._refused % 1000 == 0:  # once, then rarely: never a log flood
                        logger.warning("refused a connection to the private socket %r that did not hold its token "
                                       "(%d so far)", frames[2][:32].decode(errors="replace") if len(frames) > 2
                                       else "?", self._refused)
                request_id = frames[1] if len(frames) > 1 else b""
                zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400", b"OK" if ok else b"refused",
                                    b"", b""])
        except zmq.ContextTerminated:
            pass  # the context terminates: so does the handler
        except zmq.ZMQError as e:  # its sockets now refuse every peer (PLAIN and enforced ZAP fail closed)
            logger.error("the private sockets' token checker stopped: %s", e)
        finally:
            zap.close(linger=0)

    def close(self) -> None:
        """Removes the folder; the handler ends (and closes its socket) when the context terminates."""
        self.dir.remove()


def admits(frames: list[bytes], token: str, client_key: bytes) -> bool:
    """A ZAP request (version, id, domain, address, identity, mechanism, credentials...) of a peer that holds
    `token`: PLAIN with it, or CURVE with the client key derived from it (`client_key`, 32 bytes)."""
    if len(frames) < 7 or frames[0] != b"1.0":
        return False
    if frames[5] == b"CURVE":
        return len(frames) == 7 and hmac.compare_digest(frames[6], client_key)
    if frames[5] != b"PLAIN" or len(frames) != 8:
        return False
    return frames[6] == USER and hmac.compare_digest(frames[7], token.encode())


def connect_private(sock: zmq.Socket, address: str, token: str) -> None:
    """The connecting side: proves it holds `token` (CURVE over TCP, see the module's note), then connects."""
    if address.startswith("tcp://"):
        sock.curve_serverkey = curve_keypair(token, SERVER_KEYS)[0]
        sock.curve_publickey, sock.curve_secretkey = curve_keypair(token, CLIENT_KEYS)
    else:
        sock.plain_username = USER
        sock.plain_password = token.encode()
    sock.connect(address)
