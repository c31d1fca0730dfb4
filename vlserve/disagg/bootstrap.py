"""Bootstrap registry for encode/language disaggregation.

Encoder processes (role "encode") and language-model servers (role "language") register with one
registry process, heartbeat, and look each other up. The registry keeps everything in memory: after a
restart it is empty, and the clients' heartbeats (404 -> re-register) fill it again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from vlserve.core.errors import error_body
from vlserve.disagg.auth import HEADER, NonceMemory, PeerAuth, ReplayMemoryFull
from vlserve.disagg.registry import ROLES, Backoff, InstanceInfo, Outage, Registry, new_instance_id

__all__ = ["ROLES", "Backoff", "InstanceInfo", "BootstrapClient", "Heartbeat", "build_bootstrap_app",
           "new_instance_id"]

log = logging.getLogger("vlserve.disagg.bootstrap")

class Heartbeat(msgspec.Struct):
    instance_id: str
    load: int = 0


# Probes a load balancer or kubelet sends unsigned.
_PROBES = ("/health", "/ready")
# A router's check that this registry refuses unsigned calls (router.app.bootstrap_open): an unsigned call made to
# be refused, which is no one's intrusion and logs at debug level (any other refused call warns).
OPEN_CHECK_HEADER = "X-Vlserve-Open-Check"
# Registrations and heartbeats are a few hundred bytes: anything bigger is refused (413) unread.
MAX_BODY_BYTES = 64 * 1024


def _json(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json(error_body(message, status), status)  # the API server's error JSON, types included


class _Gate:
    """Outermost (pure ASGI): every call but the probes is judged by its headers before a byte of its body is read
    (signature there, well-formed and fresh; Content-Length within `max_body`), its body is read only up to
    `max_body`, and then the signature is checked over it, nonce included (a replay gets 401)."""

    def __init__(self, app, auth: PeerAuth, max_body: int):
        self.app, self.auth, self.max_body = app, auth, max_body
        self.nonces = NonceMemory()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _PROBES:
            return await self.app(scope, receive, send)
        request = Request(scope)  # headers only: it reads no body
        header, now = request.headers.get(HEADER), time.time()  # signatures carry wall-clock time
        if self.auth.enabled and header is None and OPEN_CHECK_HEADER in request.headers \
                and (request.method, scope["path"]) == ("GET", "/instances"):
            log.debug("refused a router's unsigned check that this registry takes signed calls only")
            return await _error("missing or invalid signature (--disagg-secret)", 401)(scope, _no_body, send)
        if not self.auth.plausible(header, now):
            return await self._refuse(request, "missing or invalid signature (--disagg-secret)", 401, send)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self._refuse(request, f"request body over {self.max_body} bytes", 413, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:  # no Content-Length (chunked), or one that lied
                return await self._refuse(request, f"request body over {self.max_body} bytes", 413, send)
            if not message.get("more_body", False):
                break
        try:
            signed = self.auth.verify(request.method, _signed_path(request.url.path, request.url.query),
                                      bytes(body), header, now, self.nonces)
        except ReplayMemoryFull as e:
            return await self._refuse(request, f"too many signed calls at once ({e}); retry", 503, send)
        if not signed:
            return await self._refuse(request, "invalid or replayed signature (--disagg-secret)", 401, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # only a disconnect can follow
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, request: Request, message: str, status: int, send) -> None:
        log.warning("refused %s %s from %s: %s", request.method, request.url.path[:64],
                    request.client.host if request.client else "?", message)
        # An unread body is the server's to discard (uvicorn closes the connection).
        await _error(message, status)(request.scope, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}


def build_bootstrap_app(heartbeat_interval: float = 1.0, failure_threshold: int = 3,
                        clock: Callable[[], float] = time.monotonic, auth: PeerAuth | None = None,
                        max_body: int = MAX_BODY_BYTES) -> FastAPI:
    """The registry as an ASGI app; `clock` is injectable so tests move time without sleeping. With `auth`
    holding a secret, every call but /health and /ready must be signed with it; a body over `max_body` bytes is
    refused (413) without being read."""
    auth = auth or PeerAuth(None)
    timeout = heartbeat_interval * failure_threshold
    # instance_id -> [info, last_seen]; insertion order keeps listings stable.
    instances: dict[str, list] = {}
    app = FastAPI(title="vlserve bootstrap registry")
    app.state.instances = instances

    def prune() -> None:
        # Lazy expiry: every request first drops whoever has been silent too long, so no timer task is needed.
        now = clock()
        for iid, (info, seen) in list(instances.items()):
            if now - seen > timeout:
                del instances[iid]
                log.info("instance %s (%s, %s) dropped: no heartbeat for %.1fs",
                         iid, info.role, info.address, now - seen)

    @app.middleware("http")
    async def _prune(request: Request, call_next):
        prune()
        return await call_next(request)

    app.add_middleware(_Gate, auth=auth, max_body=max_body)  # added last: runs first, before _prune

    @app.post("/register")
    async def register(request: Request) -> Response:
        try:
            info = msgspec.json.decode(await request.body(), type=InstanceInfo)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return _error(f"invalid registration: {e}", 400)
        if info.role not in ROLES:
            return _error(f"role must be one of {list(ROLES)}, got {info.role!r}", 400)
        if not info.address.strip():
            return _error("address must not be empty", 400)
        if not info.instance_id:
            return _error("instance_id must not be empty", 400)
        known = info.instance_id in instances
        instances[info.instance_id] = [info, clock()]
        log.info("instance %s (%s, %s) %s", info.instance_id, info.role, info.address,
                 "re-registered" if known else "registered")
        return _json({"instance_id": info.instance_id, "heartbeat_interval": heartbeat_interval})

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Response:
        try:
            hb = msgspec.json.decode(await request.body(), type=Heartbeat)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return _error(f"invalid heartbeat: {e}", 400)
        entry = instances.get(hb.instance_id)
        if entry is None:
            # Unknown or dropped: the 404 tells the client to register again.
            return _error(f"unknown instance {hb.instance_id!r}; register again", 404)
        entry[0].load = hb.load
        entry[1] = clock()
        return _json({"instance_id": hb.instance_id})

    @app.get("/instances")
    async def list_instances(role: str | None = None) -> Response:
        if role is not None and role not in ROLES:
            return _error(f"role must be one of {list(ROLES)}, got {role!r}", 400)
        found = [info for info, _ in instances.values() if role is None or info.role == role]
        return _json({"instances": found})

    @app.delete("/instances/{instance_id}")
    async def deregister(instance_id: str) -> Response:
        entry = instances.pop(instance_id, None)
        if entry is None:
            return _error(f"unknown instance {instance_id!r}", 404)
        log.info("instance %s (%s, %s) deregistered", instance_id, entry[0].role, entry[0].address)
        return _json({"instance_id": instance_id, "removed": True})

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok", "instances": len(instances)})

    @app.get("/ready")
    async def ready() -> Response:
        # The registry needs no peer: once it answers, it can take registrations.
        return _json({"status": "ready", "instances": len(instances)})

    return app


def _signed_path(path: str, query: str) -> str:
    return f"{path}?{query}" if query else path


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class BootstrapClient(Registry):
    """Registers one instance, heartbeats in the background, re-registers whenever the registry forgets it.

    While the registry cannot be reached (at start or later) the client retries with exponential backoff, from
    the heartbeat interval up to `retry_max_delay` seconds, and says so once: one warning when the registry
    becomes unreachable, a reminder every `remind_every` seconds while it stays so (each try at debug level), and
    one info line when it answers again. Connected, it heartbeats at the normal interval. `sleep`, `clock` and
    `rng` (the jitter) are injectable so tests follow the retries without waiting."""

    def __init__(self, url: str, info: InstanceInfo, heartbeat_interval: float = 1.0,
                 load_fn: Callable[[], int] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, auth: PeerAuth | None = None,
                 retry_max_delay: float = 30.0, remind_every: float = 300.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random) -> None:
        self.url = _base_url(url)
        self.info = info
        self.heartbeat_interval = heartbeat_interval
        self.load_fn = load_fn
        self._interval = heartbeat_interval
        self.auth = auth or PeerAuth(None)
        self._http = httpx.AsyncClient(base_url=self.url, transport=transport, timeout=max(2.0, 2 * heartbeat_interval),
                                       event_hooks={"request": [self._sign]})
        self._task: asyncio.Task | None = None
        self.registrations = 0  # how many times the registry accepted us (observability, tests)
        self.retry_max_delay = max(retry_max_delay, heartbeat_interval)
        self._sleep, self._clock = sleep, clock
        self.outage = Outage(f"registry at {self.address}", heartbeat_interval, self.retry_max_delay, remind_every,
                             clock, rng, log)

    @property
    def address(self) -> str:
        """host:port of the registry, for messages."""
        return self._http.base_url.netloc.decode() or self.url

    async def _sign(self, request: httpx.Request) -> None:
        path = _signed_path(request.url.path, request.url.query.decode())
        request.headers.update(self.auth.sign(request.method, path, request.content))

    def _load(self) -> int:
        return int(self.load_fn()) if self.load_fn is not None else self.info.load

    async def _register_once(self) -> None:
        """One attempt; raises httpx.HTTPError on transport trouble, ValueError when the registry refuses."""
        self.info.load = self._load()
        resp = await self._http.post("/register", content=msgspec.json.encode(self.info),
                                     headers={"content-type": "application/json"})
        if 400 <= resp.status_code < 500:
            raise ValueError(f"registry refused {self.info.instance_id}: {resp.status_code} {resp.text}")
        resp.raise_for_status()
        server_interval = resp.json().get("heartbeat_interval")
        # Beat at least as often as the registry expects, or it would drop us between beats.
        if isinstance(server_interval, (int, float)) and server_interval > 0:
            self._interval = min(self.heartbeat_interval, float(server_interval))
        self.registrations += 1
        log.info("registered %s (%s, %s) with the registry at %s%s", self.info.instance_id, self.info.role,
                 self.info.address, self.address, self.outage.ended())

    async def start(self) -> None:
        """Registers (retrying with backoff until the registry answers), then heartbeats in a background task."""
        while True:
            try:
                await self._register_once()
                break
            except httpx.HTTPError as e:
                # Expected while the registry is starting: said once, without a traceback.
                await self._sleep(self.outage.failed(e))
        self._task = asyncio.create_task(self._heartbeat_loop(), name="bootstrap-heartbeat")

    async def _heartbeat_loop(self) -> None:
        delay = self._interval
        while True:
            await self._sleep(delay)
            try:
                await self._beat()
                delay = self._interval
            except asyncio.CancelledError:
                raise
            except (httpx.HTTPError, ValueError) as e:
                # Keep trying forever (a restarted registry must get everyone back), backing off meanwhile.
                delay = self.outage.failed(e)
            except Exception:
                log.exception("unexpected heartbeat error")  # never let the loop die silently
                delay = self._interval

    async def _beat(self) -> None:
        body = msgspec.json.encode(Heartbeat(self.info.instance_id, self._load()))
        resp = await self._http.post("/heartbeat", content=body, headers={"content-type": "application/json"})
        if resp.status_code == 404:
            # (expected after an outage: a restarted registry is empty; the registration line follows)
            log.log(logging.DEBUG if self.outage.since is not None else logging.INFO,
                    "registry at %s forgot %s; registering again", self.address, self.info.instance_id)
            await self._register_once()
            return
        resp.raise_for_status()
        outage = self.outage.ended()
        if outage:  # it answered again without having forgotten us
            log.info("heartbeats to the registry at %s resumed%s", self.address, outage)

    async def wait_for_change(self, timeout: float) -> None:
        """This registry has no watch: a caller lists again after `timeout`."""
        await self._sleep(timeout)

    async def list_instances(self, role: str | None = None) -> list[InstanceInfo]:
        params = {"role": role} if role is not None else None
        resp = await self._http.get("/instances", params=params)
        resp.raise_for_status()
        return msgspec.json.decode(resp.content, type=dict[str, list[InstanceInfo]])["instances"]

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if deregister:
            try:
                resp = await self._http.delete(f"/instances/{self.info.instance_id}")
                if resp.status_code not in (200, 404):
                    log.warning("deregistering %s: %s", self.info.instance_id, resp.status_code)
            except httpx.HTTPError as e:
                # Not fatal: the registry drops us after the heartbeat timeout anyway.
                log.warning("could not deregister %s from %s (%s)", self.info.instance_id, self.url, e)
        await self._http.aclose()
