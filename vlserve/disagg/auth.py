"""Peers of a disaggregated deployment prove they hold the shared secret (`--disagg-secret`).

- The registry's HTTP API: every call is signed (HMAC-SHA256 over method, path, timestamp and body) and the
  registry refuses unsigned, forged or stale (> MAX_SKEW_S) calls.
- The ZeroMQ data channel: CurveZMQ, with keys derived from the secret. An encoder accepts only clients that
  hold the client key (ZAP), and a language server can only complete the handshake with an encoder that holds
  the server key; everything on the wire is encrypted.

Without a secret both stay open, which is allowed only on loopback addresses.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time

import zmq
from zmq.utils import z85

from vlserve.core.errors import InvalidInputError

logger = logging.getLogger("vlserve.disagg.auth")
HEADER = "x-vlserve-signature"
MAX_SKEW_S = 60.0


def _keypair(secret: str, purpose: str) -> tuple[bytes, bytes]:
    """(public, secret) Curve25519 keys in Z85, derived from the shared secret."""
    seed = hashlib.blake2b(secret.encode(), digest_size=32, person=purpose.encode()[:16]).digest()
    private = z85.encode(seed)
    return zmq.curve_public(private), private


class PeerAuth:
    """The shared secret and what follows from it; `PeerAuth(None)` leaves every channel open."""

    def __init__(self, secret: str | None):
        self.secret = secret or None
        if self.secret is not None:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE support, which --disagg-secret needs")
            self.server_public, self.server_private = _keypair(self.secret, "vlserve-encoder")
            self.client_public, self.client_private = _keypair(self.secret, "vlserve-language")
        self._authenticator = None

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    # ---- HTTP (registry) ----------------------------------------------------------------------------------
    def sign(self, method: str, path: str, body: bytes, now: float | None = None) -> dict[str, str]:
        if self.secret is None:
            return {}
        ts = f"{now if now is not None else time.time():.3f}"
        return {HEADER: f"{ts}:{self._mac(method, path, body, ts)}"}

    def verify(self, method: str, path: str, body: bytes, header: str | None, now: float | None = None) -> bool:
        if self.secret is None:
            return True
        ts, _, mac = (header or "").partition(":")
        try:
            fresh = abs((now if now is not None else time.time()) - float(ts)) <= MAX_SKEW_S
        except ValueError:
            return False
        return fresh and hmac.compare_digest(mac, self._mac(method, path, body, ts))

    def _mac(self, method: str, path: str, body: bytes, ts: str) -> str:
        msg = f"{method.upper()}\n{path}\n{ts}\n".encode() + body
        return hmac.new(self.secret.encode(), msg, hashlib.sha256).hexdigest()

    # ---- ZeroMQ (data channel) ----------------------------------------------------------------------------
    def secure_server(self, sock: zmq.Socket) -> None:
        """Before bind: CURVE server; the context's authenticator admits only holders of the client key."""
        if self.secret is None:
            return
        if self._authenticator is None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._authenticator = AsyncioAuthenticator(sock.context, log=logging.getLogger("vlserve.disagg.zap"))
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", credentials_provider=self)
        sock.curve_server = True
        sock.curve_secretkey = self.server_private
        sock.curve_publickey = self.server_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: is this client one of ours?"""
        if hmac.compare_digest(client_key, self.client_public):
            return True
        logger.warning("refused a data-channel peer without the shared secret (client key %s)",
                       client_key[:12].decode(errors="replace"))
        return False

    def secure_client(self, sock: zmq.Socket) -> None:
        """Before connect: CURVE client that only talks to an encoder holding the server key."""
        if self.secret is None:
            return
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_private

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def require_secret_off_loopback(auth: PeerAuth, host: str, role: str) -> None:
    """Open channels are acceptable only where nobody else can reach them."""
    if auth.enabled:
        return
    if not _is_loopback(host):
        raise InvalidInputError(f"{role} listens on {host} without --disagg-secret: anyone who reaches it could join "
                                "the deployment or read requests. Set --disagg-secret (or VLSERVE_DISAGG_SECRET) on "
                                "every role, or listen on a loopback address")
    logger.warning("%s runs without --disagg-secret: only safe because it listens on loopback", role)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
