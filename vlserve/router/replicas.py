"""The router's replicas: who is there (the registry, listed every --heartbeat-interval), what each has cached
(its KV events, followed on a thread by `KVEventSubscriber` into a `KVIndex`) and how busy each is (this router's
in-flight count and prefill queue, plus the running and waiting requests its /metrics shows beyond those, scraped
at the same interval), and which LoRA adapters it serves (its /v1/models, read with its metrics).

A replica that refuses a connection, fails or goes silent (--replica-read-timeout) while answering, or answers
what the router does not pass on, is avoided for a while (`avoid`); one that leaves the registry is dropped, its
requests in flight left to finish (they hold their own connections).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import threading
import time

import httpx

from vlserve.core.lora import AdapterRef
from vlserve.disagg.kv_events_subscriber import KVEventSubscriber
from vlserve.disagg.kv_index import KVIndex
from vlserve.disagg.registry import InstanceInfo, Registry
from vlserve.router.choice import ReplicaLoad

logger = logging.getLogger("vlserve.router")
OPEN_CHECK_S = 30.0  # how often a signed registry is checked to still refuse unsigned calls
AVOID_S = 5.0  # how long a replica that failed (see above) is left out (unless it is the only one)
MAX_METRICS_BYTES = 4 * 2**20  # a replica's /metrics is a few KiB; past this it is not read further
MAX_MODELS_BYTES = 4 * 2**20  # its /v1/models likewise
MAX_ADAPTERS = 4096  # adapters taken from one replica's list
MAX_ADAPTER_TEXT = 4096  # characters of an adapter's name, folder or key
SCRAPED = {"vlserve:num_requests_running": "running", "vlserve:num_requests_waiting": "waiting",
           "vlserve:kv_cache_blocks": "capacity"}


class Replica(ReplicaLoad):
    def __init__(self, info: InstanceInfo):
        super().__init__(info.instance_id)
        self.info = info
        self.url = f"http://{info.http_address}"
        self.avoid_until = 0.0
        self.answering = False  # its last /metrics scrape answered
        self.adapters: dict[str, AdapterRef] = {}  # the LoRA adapters its /v1/models lists


def parse_load(text: str) -> dict[str, int]:
    """running / waiting / capacity (KV blocks) from a replica's Prometheus text (labels ignored, values
    summed)."""
    out = {"running": 0, "waiting": 0, "capacity": 0}
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        key = SCRAPED.get(name.strip())
        if key is not None:
            try:
                value = float(rest.rsplit(" ", 1)[-1])
            except ValueError:
                continue
            if math.isfinite(value) and value >= 0:  # "+Inf", "NaN" or a negative count: not believed
                out[key] += int(value)
    return out


class EventsThread:
    """Owns the KVEventSubscriber (ZeroMQ sockets are single-threaded): adds and removes arrive by queue."""

    def __init__(self, index: KVIndex):
        self.index = index
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlserve-kv-events", daemon=True)
        self._thread.start()

    def add(self, name: str, endpoint: str) -> None:
        self._ops.put(("add", name, endpoint))

    def remove(self, name: str) -> None:
        self._ops.put(("remove", name, ""))

    def _run(self) -> None:
        sub = KVEventSubscriber(self.index)
        try:
            while not self._stop.is_set():
                while not self._ops.empty():
                    op, name, endpoint = self._ops.get()
                    if op == "add":
                        sub.add(name, endpoint)
                    else:
                        sub.remove(name)
                sub.poll(50)
        finally:
            sub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def parse_adapters(text: str) -> dict[str, AdapterRef]:
    """The LoRA adapters of a replica's /v1/models: the cards with a parent and vlserve's `lora` entry (the key
    its caches use, whether it adapts the towers). Cards that are not well-formed are left out."""
    try:
        cards = json.loads(text).get("data")
    except (ValueError, AttributeError):
        return {}
    adapters = {}
    for card in cards[:MAX_ADAPTERS + 1] if isinstance(cards, list) else []:
        lora = card.get("lora") if isinstance(card, dict) and card.get("parent") is not None else None
        if not isinstance(lora, dict):
            continue
        name, root, key, towers = card.get("id"), card.get("root", ""), lora.get("key"), lora.get("towers")
        if all(isinstance(v, str) and 0 < len(v) <= MAX_ADAPTER_TEXT for v in (name, key)) and \
                isinstance(root, str) and len(root) <= MAX_ADAPTER_TEXT and isinstance(towers, bool):
            adapters[name] = AdapterRef(name, root, key, towers)
    return adapters


class ReplicaSet:
    def __init__(self, registry: Registry, roles: tuple[str, ...], interval: float, index: KVIndex | None = None,
                 open_check=None):
        """`open_check`: an async callable saying why the registry is open to unsigned registrations now ("" when
        it is not, or cannot tell): checked before the first listing and every OPEN_CHECK_S; while it says so, no
        replica is listed (their prompts would go to whoever registered)."""
        self.registry, self.roles, self.interval = registry, roles, interval
        self.open_check, self.refused, self._checked_at = open_check, "", -math.inf
        self.index = index or KVIndex()
        self.replicas: dict[str, Replica] = {}
        self.events = EventsThread(self.index)
        self._http = httpx.AsyncClient(timeout=max(1.0, interval), headers={"accept-encoding": "identity"})
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()
        self.auth: dict[str, str] = {}  # the router's key upstream (its /v1/models sits behind the replicas' key)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.events.close()
        await self._http.aclose()
        await self.registry.stop(deregister=False)

    def adapters(self) -> dict[str, AdapterRef]:
        """Every LoRA adapter some answering replica serves (the first listing of a name wins)."""
        union: dict[str, AdapterRef] = {}
        for _, r in sorted(self.replicas.items()):
            if r.answering:
                for name, ref in r.adapters.items():
                    union.setdefault(name, ref)
        return union

    def candidates(self, exclude: set[str] = frozenset(), adapter: str | None = None) -> list[Replica]:
        """Replicas to route to, in a stable order: those not avoided, else (all avoided) every one left; with
        `adapter`, only those serving that LoRA adapter."""
        now = time.monotonic()
        left = [r for name, r in sorted(self.replicas.items())
                if name not in exclude and (adapter is None or adapter in r.adapters)]
        fine = [r for r in left if r.avoid_until <= now] or left
        for r in fine:  # what each holds now: a new conversation goes where it evicts least
            r.cached_blocks = self.index.num_blocks(r.name)
        return fine

    def avoid(self, name: str, why: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None:
            replica.avoid_until = time.monotonic() + AVOID_S
            logger.warning("replica %s (%s) avoided for %gs: %s", name, replica.info.http_address, AVOID_S, why)

    @property
    def num_answering(self) -> int:
        return sum(r.answering for r in self.replicas.values())

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the registry may be restarting: keep who we know
                logger.warning("could not list replicas (keeping the %d known): %s", len(self.replicas), e)
            try:
                await self.scrape()
            except Exception:  # noqa: BLE001 - this loop must not end: joins, leaves and /ready depend on it
                logger.exception("could not scrape the replicas' load")
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        if self.open_check is not None and time.monotonic() - self._checked_at >= OPEN_CHECK_S:
            refused = await self.open_check()
            self._checked_at = time.monotonic() if not refused else -math.inf  # refused: checked again next time
            if refused != self.refused:
                (logger.error if refused else logger.info)(
                    "%s", f"routing to no replica: {refused}" if refused else "the registry takes signed calls only")
            self.refused = refused
        listed: dict[str, InstanceInfo] = {}
        if self.refused:
            for name in list(self.replicas):
                del self.replicas[name]
                self.events.remove(name)
            self.changed.set()
            return
        for role in self.roles:
            for info in await self.registry.list_instances(role):
                if info.http_address:
                    listed[info.instance_id] = info
        for name in [n for n in self.replicas if n not in listed]:
            logger.info("replica %s (%s) left", name, self.replicas[name].info.http_address)
            del self.replicas[name]
            self.events.remove(name)
        for name, info in listed.items():
            if name not in self.replicas:
                self.replicas[name] = Replica(info)
                logger.info("replica %s (%s, %s) joined; kv events %s", name, info.role, info.http_address,
                            info.kv_events or "off (routed by load only)")
                if info.kv_events:
                    self.events.add(name, info.kv_events)
        self.changed.set()

    async def scrape(self) -> None:
        async def one(r: Replica) -> None:
            ours = r.in_flight  # as the replica counts them now (some may finish meanwhile: the max below)
            try:
                text = await self._read_metrics(r)
            except (httpx.HTTPError, ValueError):
                r.answering = False
                return
            r.answering = True
            load = await asyncio.to_thread(parse_load, text)  # up to MAX_METRICS_BYTES: off the event loop
            r.others = max(0, load["running"] + load["waiting"] - max(ours, r.in_flight))
            r.capacity_blocks = load["capacity"]
            try:
                models = await self._read(r, "/v1/models", MAX_MODELS_BYTES, self.auth)
                r.adapters = await asyncio.to_thread(parse_adapters, models)
            except (httpx.HTTPError, ValueError):
                pass  # its adapters as last read
        await asyncio.gather(*(one(r) for r in list(self.replicas.values())))

    async def _read_metrics(self, r: Replica) -> str:
        return await self._read(r, "/metrics", MAX_METRICS_BYTES)

    async def _read(self, r: Replica, path: str, limit: int, headers: dict | None = None) -> str:
        """A replica's answer at `path`, read within `limit` bytes (ValueError past it: a replica is not trusted
        to be small)."""
        async with self._http.stream("GET", f"{r.url}{path}", headers=headers) as resp:
            resp.raise_for_status()
            if resp.headers.get("content-encoding", "identity") != "identity":  # asked for none: not inflated here
                raise ValueError(f"its {path} came compressed")
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > limit:
                    raise ValueError(f"its {path} is over {limit} bytes")
        return body.decode("utf-8", "replace")
