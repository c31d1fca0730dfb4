"""Where disaggregated roles find each other: one interface, two implementations chosen by the registry URL.

- the embedded bootstrap registry (`vlserve bootstrap`, `--bootstrap HOST:PORT` or `--registry http://HOST:PORT`):
  the default on one machine; `disagg/bootstrap.py`.
- etcd (`--registry etcd://HOST:PORT[,HOST:PORT...]`, `etcds://` for TLS): membership kept where operators
  already keep it, an instance's key lives as long as its lease; `disagg/etcd_registry.py`.

A role holds one `Registry`: `start()` registers this instance (retrying until the registry answers) and keeps it
registered in the background, `list_instances(role)` says who is there, `wait_for_change(timeout)` returns when
the membership may have changed (at once on a watch event, or at the timeout), `stop()` leaves. The roles never
know which one they hold: `disagg/registries.py` `open_registry` picks it by URL.
"""

from __future__ import annotations

import logging
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import msgspec

from vlserve.core.errors import InvalidInputError

log = logging.getLogger("vlserve.disagg.registry")

# "serve": an aggregated server registered as a replica for `vlserve router` (it pairs with no peer)
ROLES = ("encode", "language", "prefill", "decode", "serve")


class InstanceInfo(msgspec.Struct):
    instance_id: str            # unique per process start (the client makes it: uuid4 hex)
    role: str                   # one of ROLES
    address: str                # host:port of its data endpoint (ZeroMQ), opaque to the registry
    http_address: str = ""      # host:port of its HTTP endpoint (health/metrics), opaque
    capacity: int = 1           # how many requests it takes at once (opaque hint)
    load: int = 0               # requests in flight, updated by heartbeats (bootstrap) or re-puts (etcd)
    kv_events: str = ""         # tcp://host:port of its KV cache events (--kv-events-endpoint), "" when off


def new_instance_id() -> str:
    return uuid.uuid4().hex


class Registry:
    """What a role needs of a registry (see the module docstring). `registrations` counts how many times the
    registry accepted this instance (a re-registration after it forgot us counts again)."""

    info: InstanceInfo
    registrations: int = 0

    @property
    def address(self) -> str:
        """Where the registry is, for messages."""
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def list_instances(self, role: str | None = None) -> list[InstanceInfo]:
        raise NotImplementedError

    async def wait_for_change(self, timeout: float) -> None:
        raise NotImplementedError

    async def stop(self, deregister: bool = True) -> None:
        raise NotImplementedError


class Backoff:
    """Delays between retries: `initial`, doubling up to `cap`, each shortened by up to `jitter` (a fraction) so
    that many clients of one restarted registry do not retry in lock-step. `reset()` after a success."""

    def __init__(self, initial: float, cap: float = 30.0, jitter: float = 0.1,
                 rng: Callable[[], float] = random.random) -> None:
        if initial <= 0 or cap < initial or not 0 <= jitter < 1:
            raise ValueError(f"need 0 < initial <= cap and 0 <= jitter < 1, got {initial}, {cap}, {jitter}")
        self.initial, self.cap, self.jitter, self.rng = initial, cap, jitter, rng
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay * (1.0 - self.jitter * self.rng())

    def reset(self) -> None:
        self._next = self.initial


class Outage:
    """What the log says while a registry is away: one warning when it becomes unreachable, a reminder every
    `remind_every` seconds while it stays so (each try at debug level), and the caller's one line when it answers
    again (`ended()` gives the outage's length for it). Also the backoff between tries."""

    def __init__(self, what: str, initial_delay: float, max_delay: float, remind_every: float,
                 clock: Callable[[], float], rng: Callable[[], float] = random.random,
                 logger: logging.Logger = log) -> None:
        self.log = logger
        self.what, self.max_delay, self.remind_every, self.clock = what, max_delay, remind_every, clock
        self.backoff = Backoff(initial_delay, max_delay, rng=rng)
        self.since: float | None = None  # when it stopped answering; None while it answers
        self._reminded_at = 0.0
        self.failures = 0

    def failed(self, e: Exception) -> float:
        """Notes one failed try; returns how long to wait before the next one."""
        delay = self.backoff.next()
        self.failures += 1
        now = self.clock()
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if self.since is None:
            self.since = self._reminded_at = now
            self.log.warning("%s unreachable (%s); retrying with backoff up to %gs", self.what, reason, self.max_delay)
        elif now - self._reminded_at >= self.remind_every:
            self._reminded_at = now
            self.log.warning("%s still unreachable after %.0fs and %d tries (%s); still retrying",
                        self.what, now - self.since, self.failures, reason)
        else:
            self.log.debug("%s unreachable (%s); next try in %.2fs", self.what, reason, delay)
        return delay

    def ended(self) -> str:
        """Notes an answer; returns "" or, after an outage, how long it lasted (for the one line that ends it)."""
        outage = "" if self.since is None else (
            f" (it was unreachable for {self.clock() - self.since:.0f}s, {self.failures} failed tries)")
        self.since, self.failures = None, 0
        self.backoff.reset()
        return outage


@dataclass(frozen=True)
class RegistryTarget:
    """A parsed --registry / --bootstrap: which implementation, and where."""

    kind: str  # "bootstrap" | "etcd"
    endpoints: tuple[str, ...]  # base URLs (http:// or https://)

    @property
    def host(self) -> str:
        """The first endpoint's host: peers route toward it to pick the address they advertise."""
        netloc = self.endpoints[0].split("://", 1)[1]
        return netloc.rsplit(":", 1)[0].strip("[]")


# URL scheme -> (implementation, scheme of its HTTP endpoints)
SCHEMES = {"http": ("bootstrap", "http"), "https": ("bootstrap", "https"), "bootstrap": ("bootstrap", "http"),
           "etcd": ("etcd", "http"), "etcds": ("etcd", "https")}


def parse_registry_url(url: str) -> RegistryTarget:
    """`etcd://h:p[,h:p]`, `etcds://...`, `http://h:p` (the bootstrap registry), or a bare `h:p` (the bootstrap,
    as --bootstrap takes it). Raises InvalidInputError with what is expected."""
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "http", text
    if scheme not in SCHEMES:
        raise InvalidInputError(f"registry {url!r}: the scheme must be one of {sorted(SCHEMES)} "
                                "(etcd://HOST:PORT[,HOST:PORT...] or http://HOST:PORT of `vlserve bootstrap`)")
    kind, http_scheme = SCHEMES[scheme]
    hosts = [h.strip() for h in rest.rstrip("/").split(",") if h.strip()]
    if not hosts or any("/" in h or "@" in h or ":" not in h for h in hosts):
        raise InvalidInputError(f"registry {url!r}: expected {scheme}://HOST:PORT"
                                f"{'[,HOST:PORT...]' if kind == 'etcd' else ''} (credentials go in --registry-user and "
                                "VLSERVE_REGISTRY_PASSWORD, not the URL)")
    if kind == "bootstrap" and len(hosts) > 1:
        raise InvalidInputError(f"registry {url!r}: the bootstrap registry is one address")
    for h in hosts:
        port = h.rsplit(":", 1)[1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError(f"registry {url!r}: {port!r} is not a port")
    return RegistryTarget(kind, tuple(f"{http_scheme}://{h}" for h in hosts))


def registry_target(opts) -> RegistryTarget:
    """The registry a role's DisaggArgs name: --registry when given, else the bootstrap at --bootstrap."""
    return parse_registry_url(opts.registry or opts.bootstrap)


def registry_namespace(opts, model: str) -> str:
    """The key prefix's name: --registry-namespace, else the model as the roles name it (quoted: one segment)."""
    return quote(opts.registry_namespace or model or "default", safe="")


def lease_ttl(opts) -> int:
    """An etcd lease's TTL (whole seconds): the failure window the bootstrap registry uses too."""
    return max(2, math.ceil(opts.heartbeat_interval * opts.heartbeat_failure_threshold))


def reachable_host(host: str, toward: str | None = None) -> str:
    """The address peers reach this host by. A wildcard bind address names no host: then the address of the
    interface that routes to `toward` (the registry, which every peer reaches too), else the host name's."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    import socket

    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((toward, 9))  # UDP: picks the route, sends nothing
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def advertised_host(opts, bind_host: str) -> str:
    """The host this instance puts in the registry: --advertise-host, else one derived from the bind address."""
    if opts.advertise_host:
        return opts.advertise_host.strip()
    return reachable_host(bind_host, toward=registry_target(opts).host)


def advertised_events_endpoint(endpoint: str | None, host: str) -> str:
    """The KV events endpoint a router connects to: `endpoint` (tcp://HOST:PORT as bound) with a wildcard host
    replaced by this instance's advertised `host`; "" when off, or when its port is `*` (known only to the engine
    process, so a router could not find it: give a fixed port)."""
    if not endpoint or endpoint.startswith("ipc://"):  # (a local subscriber's, e.g. a Dynamo worker's relay)
        return ""
    bind_host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if port == "*":
        log.warning("--kv-events-endpoint %s: a free port (*) cannot be advertised to routers; give a fixed port",
                    endpoint)
        return ""
    if bind_host in ("*", "0.0.0.0", "[::]", "::", ""):
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"
