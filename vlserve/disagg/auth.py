"""Peers of a disaggregated deployment prove they hold the shared secret (`--disagg-secret`).

- The registry's HTTP API: every call is signed (HMAC-SHA256 over method, path, timestamp, a random nonce and
  body) and the registry refuses unsigned, forged, stale (> MAX_SKEW_S) or replayed (nonce already seen) calls.
  The header alone (present, well-formed, fresh) is checked before a byte of the body is read.
- The ZeroMQ data channel: CurveZMQ, with keys derived from the secret. An encoder accepts only clients that
  hold the client key (ZAP), and a language server can only complete the handshake with an encoder that holds
  the server key; everything on the wire is encrypted.

The roles of a deployment (encode, prefill, language, decode) refuse to start without a secret: on a shared
machine a loopback port is open to every local user, who could otherwise steer a role (`serve --disagg` makes a
secret for its roles when none is given). The bootstrap registry, a router and a replica announcing itself may run
without one on loopback: a registry only says where peers are, and they prove the secret on the data channel.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import ipaddress
import logging
import re
import secrets
import time

import zmq

from vlserve.core.curve_keys import curve_keypair
from vlserve.core.errors import InvalidInputError

logger = logging.getLogger("vlserve.disagg.auth")
HEADER = "x-vlserve-signature"
MAX_SKEW_S = 60.0
MAX_NONCES = 65536  # replay memory: ~1000 signed calls/s over the freshness window, ~15 MB when full
# "<unix time>:<32 hex nonce>:<64 hex HMAC>"
_HEADER_RE = re.compile(r"(\d{1,12}(?:\.\d{1,6})?):([0-9a-f]{32}):([0-9a-f]{64})")


class ReplayMemoryFull(Exception):
    """More fresh signed calls than MAX_NONCES: refuse (the caller retries) rather than forget a nonce early."""


class NonceMemory:
    """The nonces of accepted calls, each kept until its signature goes stale (its timestamp + MAX_SKEW_S): after
    that the freshness check refuses a replay anyway. Bounded: evicted by time, at most `max_entries`."""

    def __init__(self, max_entries: int = MAX_NONCES):
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (expiry, nonce), soonest first

    def __len__(self) -> int:
        return len(self._expiry)

    def admit(self, nonce: str, ts: float, now: float) -> bool:
        """False if `nonce` was seen within the window; raises ReplayMemoryFull when it cannot remember it."""
        while self._heap and self._heap[0][0] < now:
            del self._expiry[heapq.heappop(self._heap)[1]]
        if nonce in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise ReplayMemoryFull(f"{len(self._expiry)} fresh signatures remembered, the most it keeps")
        self._expiry[nonce] = ts + MAX_SKEW_S
        heapq.heappush(self._heap, (ts + MAX_SKEW_S, nonce))
        return True


class PeerAuth:
    """The shared secret and what follows from it; `PeerAuth(None)` leaves every channel open."""

    def __init__(self, secret: str | None):
        self.secret = secret or None
        if self.secret is not None:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE support, which --disagg-secret needs")
            self.server_public, self.server_private = curve_keypair(self.secret, "vlserve-encoder")
            self.client_public, self.client_private = curve_keypair(self.secret, "vlserve-language")
        self._authenticator = None

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    # ---- HTTP (registry) ----------------------------------------------------------------------------------
    def sign(self, method: str, path: str, body: bytes, now: float | None = None) -> dict[str, str]:
        if self.secret is None:
            return {}
        ts = f"{now if now is not None else time.time():.3f}"
        nonce = secrets.token_hex(16)  # a fresh one per call: the registry refuses it a second time
        return {HEADER: f"{ts}:{nonce}:{self._mac(method, path, body, ts, nonce)}"}

    def plausible(self, header: str | None, now: float | None = None) -> bool:
        """What can be checked before reading the body: the header is there, well-formed and fresh."""
        return self.secret is None or self._parse(header, now) is not None

    def verify(self, method: str, path: str, body: bytes, header: str | None, now: float | None = None,
               nonces: NonceMemory | None = None) -> bool:
        """A fresh, well-formed signature of exactly this call; with `nonces`, also one never seen before
        (remembered from here on). Raises ReplayMemoryFull when `nonces` cannot take one more."""
        if self.secret is None:
            return True
        parsed = self._parse(header, now)
        if parsed is None:
            return False
        ts, nonce, mac = parsed
        if not hmac.compare_digest(mac, self._mac(method, path, body, ts, nonce)):
            return False
        # Only a valid signature is remembered: a forger cannot fill the memory.
        now = now if now is not None else time.time()
        return nonces is None or nonces.admit(nonce, float(ts), now)

    def _parse(self, header: str | None, now: float | None) -> tuple[str, str, str] | None:
        m = _HEADER_RE.fullmatch(header or "")
        if m is None or abs((now if now is not None else time.time()) - float(m[1])) > MAX_SKEW_S:
            return None
        return m[1], m[2], m[3]

    def _mac(self, method: str, path: str, body: bytes, ts: str, nonce: str) -> str:
        msg = f"{method.upper()}\n{path}\n{ts}\n{nonce}\n".encode() + body
        return hmac.new(self.secret.encode(), msg, hashlib.sha256).hexdigest()

    # ---- ZeroMQ (data channel) ----------------------------------------------------------------------------
    def secure_server(self, sock: zmq.Socket) -> None:
        """Before bind: CURVE server; the context's authenticator admits only holders of the client key."""
        if self.secret is None:
            return
        if self._authenticator is None:
            import zmq.asyncio
            from zmq.auth.asyncio import AsyncioAuthenticator
            from zmq.auth.thread import ThreadAuthenticator

            # a socket served by a thread of its own (a transport's row socket) has a plain context
            kind = AsyncioAuthenticator if isinstance(sock.context, zmq.asyncio.Context) else ThreadAuthenticator
            self._authenticator = kind(sock.context, log=logging.getLogger("vlserve.disagg.zap"))
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


def require_secret(auth: PeerAuth, role: str) -> None:
    """A role's data channel takes peers' work and writes into peers' memory: only with the shared secret, on any
    address (a loopback port is open to every user of the machine)."""
    if not auth.enabled:
        raise InvalidInputError(f"{role} needs the deployment's shared secret: set --disagg-secret (better the env "
                                "variable VLSERVE_DISAGG_SECRET) on every role. Without it any user who reaches its "
                                "ports, on this machine too, could steer it. `vlserve serve --disagg` makes one for "
                                "its roles")


def require_secret_off_loopback(auth: PeerAuth, host: str, role: str) -> None:
    """Open channels are acceptable only where nobody else can reach them."""
    if auth.enabled:
        return
    if not is_loopback(host):
        raise InvalidInputError(f"{role} listens on {host} without --disagg-secret: anyone who reaches it could join "
                                "the deployment or read requests. Set --disagg-secret (or VLSERVE_DISAGG_SECRET) on "
                                "every role, or listen on a loopback address")
    logger.warning("%s runs without --disagg-secret: only safe because it listens on loopback", role)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
