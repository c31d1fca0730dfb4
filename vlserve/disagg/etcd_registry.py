"""The etcd registry: this instance is the key `/vlserve/<namespace>/<role>/<instance id>` holding its
InstanceInfo (JSON), attached to a lease whose TTL is the failure window (--heartbeat-interval x
--heartbeat-failure-threshold, whole seconds). Keep-alives replace heartbeats: an instance that dies stops
renewing and etcd deletes its key when the lease runs out. A watch on the namespace (not polling) keeps a local
view of everyone, so `list_instances` reads memory and `wait_for_change` wakes on a join or a leave.

Recovery: a keep-alive that finds the lease gone (etcd lost it: wiped, or the lease ran out while we could not
reach it) grants a new lease and puts the key again, without a restart. A restarted etcd with its data dir keeps
the lease (etcd refreshes every lease's TTL when a leader is elected). A watch that breaks or whose revision was
compacted lists the namespace again and watches from there; so does one that may have missed events while the
keep-alives could not get through (a network cut leaves a watch stream silent, not broken).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from vlserve.core.errors import ConfigurationError
from vlserve.disagg.etcd_client import EtcdClient, EtcdError, WatchCompacted
from vlserve.disagg.registry import ROLES, InstanceInfo, Outage, Registry

log = logging.getLogger("vlserve.disagg.registry")

LEASE_NOT_FOUND = 5  # gRPC NotFound: the lease a put names is gone
# gRPC InvalidArgument (etcd: bad user or password), PermissionDenied, Unauthenticated: no retry helps. Anything
# else (unreachable, no leader yet, too many requests) is waited out.
REFUSED = frozenset({3, 7, 16})


class EtcdRegistry(Registry):
    def __init__(self, client: EtcdClient, info: InstanceInfo, namespace: str, ttl: int,
                 heartbeat_interval: float = 1.0, load_fn: Callable[[], int] | None = None,
                 retry_max_delay: float = 30.0, remind_every: float = 300.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.info, self.ttl = client, info, int(ttl)
        self.prefix = f"/vlserve/{namespace}/"
        self.key = f"{self.prefix}{info.role}/{info.instance_id}"
        self.heartbeat_interval, self.load_fn = heartbeat_interval, load_fn
        self._sleep = sleep
        self.registrations = 0
        self.lease = 0
        self._put_load: int | None = None  # the load in the key as last put
        self._view: dict[str, InstanceInfo] = {}  # key -> instance, as the watch has seen it
        self._synced = False  # the view came from a listing (else list_instances asks etcd)
        self._changed = asyncio.Event()
        self._resync = asyncio.Event()  # the keep-alives were cut off: the watch may have missed events
        self._reachable = asyncio.Event()  # the keep-alives got through again: a broken watch retries now
        self._tasks: list[asyncio.Task] = []
        self.outage = Outage(f"etcd registry at {client.endpoint}", max(0.1, heartbeat_interval),
                             max(retry_max_delay, heartbeat_interval), remind_every, clock)
        self._watch_outage = Outage(f"etcd watch at {client.endpoint}", max(0.1, heartbeat_interval),
                                    max(retry_max_delay, heartbeat_interval), remind_every, clock)

    @property
    def address(self) -> str:
        return self.client.endpoint

    def _load(self) -> int:
        return int(self.load_fn()) if self.load_fn is not None else self.info.load

    # ---- registration ------------------------------------------------------------------------------------------
    async def _register(self) -> None:
        """A fresh lease and our key on it."""
        self.lease, granted = await self.client.grant(self.ttl)
        self.info.load = self._load()
        await self.client.put(self.key, msgspec.json.encode(self.info), self.lease)
        self._put_load = self.info.load
        self.registrations += 1
        self._reachable.set()
        log.info("registered %s (%s, %s) in etcd at %s under %s (lease TTL %ds)%s", self.info.instance_id,
                 self.info.role, self.info.address, self.client.endpoint, self.prefix, granted, self.outage.ended())

    async def start(self) -> None:
        """Registers (retrying with backoff until etcd answers), lists who is there, then keeps the lease alive and
        the view current in the background."""
        while True:
            try:
                await self._register()
                break
            except EtcdError as e:
                if e.code in REFUSED:  # a restart would be refused the same way: the operator must act
                    raise ConfigurationError(f"etcd at {self.client.endpoint} refused to register this instance: "
                                             f"{e} (check --registry-user / VLSERVE_REGISTRY_PASSWORD and the "
                                             "user's permissions on /vlserve/)") from None
                await self._sleep(self.outage.failed(e))
        self._tasks = [asyncio.create_task(self._keepalive_loop(), name="etcd-keepalive"),
                       asyncio.create_task(self._watch_loop(), name="etcd-watch")]

    async def _keepalive_loop(self) -> None:
        delay = self._renew_every()
        while True:
            await self._sleep(delay)
            try:
                await self._keepalive()
                delay = self._renew_every()
            except asyncio.CancelledError:
                raise
            except EtcdError as e:  # keep trying forever: etcd coming back must get everyone back
                delay = min(self.outage.failed(e), self._renew_every())
                self._resync.set()
            except Exception:
                log.exception("unexpected etcd keep-alive error")  # never let the loop die silently
                delay = self._renew_every()

    def _renew_every(self) -> float:
        # A third of the TTL: two keep-alives may be lost before etcd lets the lease run out. The load a
        # listing shows is at most a heartbeat old.
        return max(0.05, min(self.ttl / 3.0, self.heartbeat_interval))

    async def _keepalive(self) -> None:
        if await self.client.keepalive(self.lease) <= 0:
            log.log(logging.DEBUG if self.outage.since is not None else logging.INFO,
                    "etcd at %s no longer knows the lease of %s; registering again", self.client.endpoint,
                    self.info.instance_id)
            await self._register()
            return
        load = self._load()
        if load != self._put_load:
            self.info.load = load
            try:
                await self.client.put(self.key, msgspec.json.encode(self.info), self.lease)
            except EtcdError as e:
                if e.code != LEASE_NOT_FOUND:
                    raise
                await self._register()
                return
            self._put_load = load
        outage = self.outage.ended()
        if outage:
            log.info("keep-alives to etcd at %s resumed%s", self.client.endpoint, outage)
            self._reachable.set()

    # ---- membership --------------------------------------------------------------------------------------------
    def _decode(self, key: str, value: bytes) -> InstanceInfo | None:
        rest = key[len(self.prefix):].split("/")
        if len(rest) != 2 or rest[0] not in ROLES:
            return None
        try:
            info = msgspec.json.decode(value, type=InstanceInfo)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            log.warning("etcd key %s holds no instance (%s): ignored", key[:120], e)
            return None
        return info if info.role == rest[0] and info.instance_id == rest[1] else None

    def _apply(self, kind: str, key: str, value: bytes) -> None:
        if kind == "delete":
            gone = self._view.pop(key, None)
            if gone is not None:
                log.info("etcd: %s %s (%s) left", gone.role, gone.instance_id[:8], gone.address)
            return
        info = self._decode(key, value)
        if info is None:
            return
        if key not in self._view:
            log.info("etcd: %s %s (%s) joined", info.role, info.instance_id[:8], info.address)
        self._view[key] = info

    async def _list(self) -> int:
        revision, kvs = await self.client.get_prefix(self.prefix)
        old = set(self._view)
        self._view = {}
        for key, value in kvs:
            if (info := self._decode(key, value)) is not None:
                self._view[key] = info
        if set(self._view) != old:
            self._changed.set()
        self._synced = True
        return revision

    async def _watch_loop(self) -> None:
        while True:
            self._resync.clear()
            try:
                revision = await self._list()
                self._reachable.clear()  # watching again: an older "etcd is back" is news no more
                outage = self._watch_outage.ended()
                if outage:
                    log.info("etcd watch at %s resumed%s", self.client.endpoint, outage)
                await self._follow(self.client.watch_prefix(self.prefix, revision + 1))
            except asyncio.CancelledError:
                raise
            except WatchCompacted as e:
                log.info("etcd watch: %s; listing again", e)
            except EtcdError as e:
                # While the keep-alives already report etcd's absence, the watch retries quietly.
                silent = self.outage.since is not None
                await self._retry_after(self._watch_outage.backoff.next() if silent else self._watch_outage.failed(e))
            except Exception:
                log.exception("unexpected etcd watch error")
                await self._retry_after(self.heartbeat_interval)

    async def _retry_after(self, delay: float) -> None:
        """The watch's backoff, cut short once when the keep-alives get through again: after a long outage the
        backoff has grown (up to retry_max_delay), and joins and leaves would go unseen that long after etcd is
        back."""
        sleep, back = asyncio.ensure_future(self._sleep(delay)), asyncio.ensure_future(self._reachable.wait())
        try:
            await asyncio.wait({sleep, back}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            back.cancel()
        self._reachable.clear()

    async def _follow(self, stream) -> None:
        """Applies the stream's batches until it ends or a resync is asked for (then lists again: events may
        have been missed while etcd was out of reach)."""
        resync = asyncio.ensure_future(self._resync.wait())
        batch: asyncio.Future | None = None
        try:
            while True:
                batch = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({batch, resync}, return_when=asyncio.FIRST_COMPLETED)
                if not batch.done():
                    return
                try:
                    events = batch.result()
                except StopAsyncIteration:
                    return
                batch = None
                for ev in events:
                    self._apply(ev.kind, ev.key, ev.value)
                self._changed.set()
        finally:
            resync.cancel()
            if batch is not None and not batch.done():
                batch.cancel()  # closes the stream (the generator's `async with`)
                try:
                    await batch
                except (asyncio.CancelledError, Exception):
                    pass
            await stream.aclose()

    async def list_instances(self, role: str | None = None) -> list[InstanceInfo]:
        if not self._synced:
            await self._list()
        return [i for i in self._view.values() if role is None or i.role == role]

    async def wait_for_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return
        self._changed.clear()

    async def stop(self, deregister: bool = True) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if deregister and self.lease:
            try:
                await self.client.revoke(self.lease)  # deletes our key at once: peers see us leave now
            except EtcdError as e:
                log.warning("could not revoke the lease of %s in etcd (%s); it runs out in %ds", self.info.instance_id,
                            e, self.ttl)
        await self.client.aclose()
