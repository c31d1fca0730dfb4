"""A small asyncio client of etcd v3 over its JSON gateway (`/v3/...`, served by every etcd >= 3.4 on the client
port), on httpx.

Why not a client library: `etcd3` is unmaintained since 2020 and pins an old grpcio/protobuf; `etcd3gw` talks to
the same gateway but synchronously (requests), so every watch would hold a thread; `aetcd` is asyncio but brings
grpcio and protobuf for the seven calls a registry needs. httpx is already a dependency, and the gateway is
etcd's documented HTTP API: leases, puts, ranges, deletes, watches (a streamed response, one JSON object per
line), user/password authentication and TLS.

Keys and values travel base64-encoded; 64-bit numbers come as strings; fields with zero values are left out.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from vlserve.core.errors import InvalidInputError

log = logging.getLogger("vlserve.disagg.etcd")

UNAUTHENTICATED = 16  # gRPC status code of an expired or invalid auth token
# A refused client certificate can surface as a bare SSLError on the first read (TLS 1.3 sends the alert after
# the handshake), which httpx does not wrap.
CONNECTION_ERRORS = (httpx.TransportError, ssl.SSLError)


class EtcdError(Exception):
    """etcd answered with an error (gRPC `code`, etcd's message)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered (connection refused, timed out, reset)."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: list again, then watch from there."""


@dataclass(frozen=True)
class EtcdCredentials:
    user: str | None = None
    password: str | None = None
    ca_file: str | None = None  # verify the server against this CA (else the system's)
    cert_file: str | None = None  # client certificate (etcd's --client-cert-auth)
    key_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise InvalidInputError("--registry-user needs its password in VLSERVE_REGISTRY_PASSWORD "
                                    "(--registry-password), and a password needs --registry-user")
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidInputError("--registry-cert and --registry-key go together")

    def ssl_context(self) -> ssl.SSLContext:
        """How https:// endpoints are checked: against --registry-ca (else the system's CAs), presenting the
        client certificate when one is given."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise InvalidInputError(f"etcd TLS files (--registry-ca/--registry-cert/--registry-key): {e}") from None
        return ctx


@dataclass
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes
    revision: int


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def prefix_end(prefix: str) -> str:
    """The range end that makes [prefix, end) every key starting with `prefix` (its last byte plus one)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return _b64(bytes(raw))
        raw.pop()
    return _b64(b"\0")  # every key


class EtcdClient:
    """Talks to the first endpoint that answers and stays with it; a connection error moves to the next."""

    def __init__(self, endpoints: list[str], credentials: EtcdCredentials | None = None, timeout: float = 5.0):
        if not endpoints:
            raise InvalidInputError("an etcd registry needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.creds = credentials or EtcdCredentials()
        self._current = 0
        # A watch is a response that never ends: no read timeout there (see watch()).
        self._http = httpx.AsyncClient(timeout=timeout, verify=self.creds.ssl_context())
        self._token: str | None = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _authenticate(self, base: str) -> None:
        resp = await self._http.post(f"{base}/v3/auth/authenticate",
                                     json={"name": self.creds.user, "password": self.creds.password})
        body = _decode(resp)
        self._token = body.get("token")
        if not self._token:
            raise EtcdError("etcd authentication returned no token")

    async def _call(self, path: str, body: dict) -> dict:
        """POSTs to the current endpoint, then each other one on connection trouble; re-authenticates once when
        the token is refused (tokens expire)."""
        last: Exception | None = None
        for step in range(len(self.endpoints)):
            index = (self._current + step) % len(self.endpoints)
            base = self.endpoints[index]
            try:
                if self.creds.user and self._token is None:
                    await self._authenticate(base)
                try:
                    result = _decode(await self._http.post(f"{base}{path}", json=body, headers=self._headers()))
                except EtcdError as e:
                    if e.code != UNAUTHENTICATED or not self.creds.user:
                        raise
                    await self._authenticate(base)
                    result = _decode(await self._http.post(f"{base}{path}", json=body, headers=self._headers()))
            except CONNECTION_ERRORS as e:
                last = e
                self._token = None  # another member may not know this token
                continue
            if index != self._current:
                log.info("etcd: now talking to %s", base)
                self._current = index
            return result
        raise EtcdUnavailable(f"no etcd endpoint answered ({', '.join(self.endpoints)}): "
                              f"{type(last).__name__}: {last}")

    # ---- leases ------------------------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        body = await self._call("/v3/lease/grant", {"TTL": int(ttl)})
        return int(body["ID"]), int(body.get("TTL", ttl))

    async def keepalive(self, lease: int) -> int:
        """Renews the lease; its TTL now, 0 when etcd no longer knows it (expired, revoked, a wiped etcd)."""
        body = await self._call("/v3/lease/keepalive", {"ID": lease})
        return int(body.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """Ends the lease and deletes every key attached to it."""
        try:
            await self._call("/v3/lease/revoke", {"ID": lease})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # ---- keys --------------------------------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Returns the store's revision after the put. Raises EtcdError (code 5) when the lease is gone."""
        req = {"key": _b64(key), "value": _b64(value)}
        if lease:
            req["lease"] = lease
        return _revision(await self._call("/v3/kv/put", req))

    async def get_prefix(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        """(the store's revision, every (key, value) under `prefix`), read in one consistent range."""
        body = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": prefix_end(prefix)})
        kvs = [(base64.b64decode(kv["key"]).decode(errors="replace"), base64.b64decode(kv.get("value", "")))
               for kv in body.get("kvs", [])]
        return _revision(body), kvs

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    # ---- watches -----------------------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Every change under `prefix` from `start_revision` on, a batch at a time, for as long as the stream
        lasts. Raises WatchCompacted when that revision is gone, EtcdUnavailable when the stream breaks."""
        req = {"create_request": {"key": _b64(prefix), "range_end": prefix_end(prefix),
                                  "start_revision": int(start_revision)}}
        if self.creds.user and self._token is None:
            await self._call("/v3/kv/range", {"key": _b64(prefix), "limit": 1})  # authenticates
        base = self.endpoint
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)
        try:
            async with self._http.stream("POST", f"{base}/v3/watch", json=req, headers=self._headers(),
                                         timeout=timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    _decode(resp)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise EtcdError(str(msg["error"].get("message", msg["error"])),
                                        int(msg["error"].get("grpc_code", msg["error"].get("code", 0))))
                    result = msg.get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise WatchCompacted(f"revision {start_revision} compacted (now at "
                                             f"{result['compact_revision']})")
                    if result.get("canceled"):
                        raise EtcdError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
                    events = [_event(ev) for ev in result.get("events", [])]
                    if events:
                        yield events
        except CONNECTION_ERRORS as e:
            self._current = (self._current + 1) % len(self.endpoints)  # the next try goes elsewhere
            self._token = None
            raise EtcdUnavailable(f"etcd watch at {base} broke: {type(e).__name__}: {e}") from None
        raise EtcdUnavailable(f"etcd at {base} ended the watch")


def _decode(resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        raise EtcdError(f"etcd answered {resp.status_code} with no JSON: {resp.text[:200]!r}") from None
    if resp.status_code != 200 or "error" in body:
        raise EtcdError(str(body.get("message") or body.get("error") or resp.status_code), int(body.get("code", 0)))
    return body


def _revision(body: dict) -> int:
    return int(body.get("header", {}).get("revision", 0))


def _event(ev: dict) -> WatchEvent:
    kv = ev.get("kv", {})
    kind = "delete" if ev.get("type") == "DELETE" else "put"  # PUT is the zero value: often left out
    return WatchEvent(kind, base64.b64decode(kv.get("key", "")).decode(errors="replace"),
                      base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)))
