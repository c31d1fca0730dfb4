"""Bootstrap registry: endpoints with a fake clock, the client's retry/re-register, and the real CLI process."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_utils import HTTP, free_port, wait_healthy
from vlserve.disagg.bootstrap import (
    Backoff,
    BootstrapClient,
    InstanceInfo,
    build_bootstrap_app,
    new_instance_id,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reg(iid: str, role: str = "encode", address: str = "10.0.0.1:5555", **kw) -> dict:
    return {"instance_id": iid, "role": role, "address": address, **kw}


def _ids(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [i["instance_id"] for i in resp.json()["instances"]]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://registry")


class RecordingTransport(httpx.AsyncBaseTransport):
    """Wraps a transport: records (path, status) and fails the first `fail_first` calls like a dead registry."""

    def __init__(self, inner: httpx.AsyncBaseTransport, fail_first: int = 0) -> None:
        self.inner, self.fail_first, self.calls = inner, fail_first, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.fail_first > 0:
            self.fail_first -= 1
            self.calls.append((request.url.path, None))
            raise httpx.ConnectError("connection refused", request=request)
        resp = await self.inner.handle_async_request(request)
        self.calls.append((request.url.path, resp.status_code))
        return resp


async def _wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_register_list_heartbeat_deregister():
    async def main():
        clock = FakeClock()
        app = build_bootstrap_app(heartbeat_interval=1.0, failure_threshold=3, clock=clock)
        async with _client(app) as c:
            r = await c.post("/register", json=_reg("e1", capacity=4, http_address="10.0.0.1:8001"))
            assert r.status_code == 200 and r.json() == {"instance_id": "e1", "heartbeat_interval": 1.0}
            assert (await c.post("/register", json=_reg("l1", role="language"))).status_code == 200
            assert _ids(await c.get("/instances")) == ["e1", "l1"]
            info = (await c.get("/instances", params={"role": "encode"})).json()["instances"][0]
            assert info == {"instance_id": "e1", "role": "encode", "address": "10.0.0.1:5555",
                            "http_address": "10.0.0.1:8001", "capacity": 4, "load": 0, "kv_events": ""}

            r = await c.post("/heartbeat", json={"instance_id": "e1", "load": 3})
            assert r.status_code == 200
            assert (await c.get("/instances", params={"role": "encode"})).json()["instances"][0]["load"] == 3
            assert (await c.post("/heartbeat", json={"instance_id": "nope", "load": 0})).status_code == 404

            # Re-registering the same id replaces the entry, no duplicate.
            await c.post("/register", json=_reg("e1", address="10.0.0.9:5555"))
            inst = (await c.get("/instances", params={"role": "encode"})).json()["instances"]
            assert [i["address"] for i in inst] == ["10.0.0.9:5555"]

            assert (await c.delete("/instances/e1")).status_code == 200
            assert (await c.delete("/instances/e1")).status_code == 404
            assert _ids(await c.get("/instances")) == ["l1"]
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).json()["status"] == "ready"
    asyncio.run(main())


def test_validation_errors_are_400_json():
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        async with _client(app) as c:
            for body in (_reg("x", role="decoder"), _reg("x", address=""), {"role": "encode"}):
                r = await c.post("/register", json=body)
                assert r.status_code == 400, body
                err = r.json()["error"]
                assert set(err) >= {"message", "type", "code"} and err["code"] == 400
            r = await c.post("/register", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert (await c.post("/heartbeat", json={"load": 1})).status_code == 400
            assert (await c.get("/instances", params={"role": "bogus"})).status_code == 400
            assert _ids(await c.get("/instances")) == []
    asyncio.run(main())


def test_list_by_role():
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        async with _client(app) as c:
            for iid, role in [("e1", "encode"), ("l1", "language"), ("e2", "encode")]:
                await c.post("/register", json=_reg(iid, role=role))
            assert _ids(await c.get("/instances", params={"role": "encode"})) == ["e1", "e2"]
            assert _ids(await c.get("/instances", params={"role": "language"})) == ["l1"]
            assert _ids(await c.get("/instances")) == ["e1", "l1", "e2"]
    asyncio.run(main())


def test_silent_instance_dropped_after_threshold(caplog):
    async def main():
        clock = FakeClock()
        app = build_bootstrap_app(heartbeat_interval=1.0, failure_threshold=3, clock=clock)
        async with _client(app) as c:
            await c.post("/register", json=_reg("quiet"))
            await c.post("/register", json=_reg("chatty", role="language"))
            clock.now += 2.5
            await c.post("/heartbeat", json={"instance_id": "chatty", "load": 1})
            clock.now += 0.5  # quiet: 3.0s silent, exactly the limit, still alive
            assert _ids(await c.get("/instances")) == ["quiet", "chatty"]
            clock.now += 0.6  # quiet: 3.6s > 3.0s -> dropped; chatty: 1.1s -> alive
            with caplog.at_level(logging.INFO, logger="vlserve.disagg.bootstrap"):
                assert _ids(await c.get("/instances")) == ["chatty"]
            assert any("instance quiet (encode, 10.0.0.1:5555) dropped: no heartbeat for 3.6s" in m
                       for m in caplog.messages)
            # A dropped instance's heartbeat is told to register again.
            assert (await c.post("/heartbeat", json={"instance_id": "quiet", "load": 0})).status_code == 404
    asyncio.run(main())


def test_client_reregisters_after_being_dropped():
    async def main():
        clock = FakeClock()
        app = build_bootstrap_app(heartbeat_interval=1.0, failure_threshold=3, clock=clock)
        transport = RecordingTransport(httpx.ASGITransport(app=app))
        info = InstanceInfo(instance_id=new_instance_id(), role="encode", address="127.0.0.1:7000")
        load = {"n": 0}
        client = BootstrapClient("registry:8998", info, heartbeat_interval=0.01,
                                 load_fn=lambda: load["n"], transport=transport)
        await client.start()
        assert client.registrations == 1
        assert [i.instance_id for i in await client.list_instances("encode")] == [info.instance_id]
        assert await client.list_instances("language") == []

        load["n"] = 5  # heartbeats carry load_fn()
        await _wait_for(lambda: ("/heartbeat", 200) in transport.calls)
        await asyncio.sleep(0.03)
        assert (await client.list_instances())[0].load == 5

        # Silence beyond the threshold: the registry drops it; the next heartbeat's 404 re-registers it. The clock
        # jumps again until that happens: a heartbeat already past the registry's expiry check when the clock jumps
        # lands on the new time and keeps the entry alive.
        deadline = time.monotonic() + 10
        while ("/heartbeat", 404) not in transport.calls:
            assert time.monotonic() < deadline, "the registry never dropped the silent instance"
            clock.now += 10.0
            await asyncio.sleep(0.05)
        await _wait_for(lambda: client.registrations == 2)
        assert transport.calls.count(("/register", 200)) == 2
        assert [i.instance_id for i in await client.list_instances("encode")] == [info.instance_id]

        await client.stop()
        assert transport.calls[-1] == (f"/instances/{info.instance_id}", 200)
        assert app.state.instances == {}
    asyncio.run(main())


def test_client_start_retries_until_registry_answers(caplog):
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        transport = RecordingTransport(httpx.ASGITransport(app=app), fail_first=2)
        info = InstanceInfo(instance_id=new_instance_id(), role="language", address="127.0.0.1:7001")
        client = BootstrapClient("http://registry:8998/", info, heartbeat_interval=0.01, transport=transport)
        with caplog.at_level(logging.WARNING, logger="vlserve.disagg.bootstrap"):
            await client.start()
        assert [c[1] for c in transport.calls[:3]] == [None, None, 200]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and all(r.exc_info is None for r in warnings)  # one line, no traceback
        assert [i.instance_id for i in await client.list_instances()] == [info.instance_id]
        await client.stop(deregister=False)
        assert info.instance_id in app.state.instances  # left to expire
    asyncio.run(main())


def test_client_survives_registry_outage():
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        transport = RecordingTransport(httpx.ASGITransport(app=app))
        info = InstanceInfo(instance_id=new_instance_id(), role="encode", address="127.0.0.1:7002")
        client = BootstrapClient("registry", info, heartbeat_interval=0.01, transport=transport)
        await client.start()
        transport.fail_first = 3  # registry down for three heartbeats...
        app.state.instances.clear()  # ...and comes back empty, like a restart
        await _wait_for(lambda: client.registrations == 2)
        assert info.instance_id in app.state.instances
        await client.stop()
    asyncio.run(main())


class StepSleep:
    """A fake `sleep` for BootstrapClient: records each delay and moves `clock` by it. With `manual`, every sleep
    waits for the test's `step()`, so the test walks the heartbeat loop one beat at a time."""

    def __init__(self, clock: FakeClock, manual: bool = False) -> None:
        self.clock, self.manual, self.delays = clock, manual, []
        self._go: asyncio.Queue = asyncio.Queue()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.clock.now += delay
        if self.manual:
            await self._go.get()
        else:
            await asyncio.sleep(0)

    async def step(self, n: int = 1) -> None:
        """Lets n sleeps end, and returns once the loop is asleep again."""
        for _ in range(n):
            before = len(self.delays)
            self._go.put_nowait(None)
            await _wait_for(lambda n=before: len(self.delays) > n)


def _records(caplog, level: int) -> list[str]:
    """The client's log lines at `level` (the in-process registry's own lines start with "instance")."""
    return [m for r in caplog.records if r.levelno == level and r.name == "vlserve.disagg.bootstrap"
            and not (m := r.getMessage()).startswith("instance ")]


def test_backoff_doubles_up_to_the_cap_with_jitter_and_resets():
    b = Backoff(1.0, cap=30.0, rng=lambda: 0.0)
    assert [b.next() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    b.reset()
    assert b.next() == 1
    shortest = Backoff(1.0, cap=30.0, jitter=0.1, rng=lambda: 1.0)  # jitter only shortens: never above the cap
    assert [round(shortest.next(), 6) for _ in range(7)] == [0.9, 1.8, 3.6, 7.2, 14.4, 27.0, 27.0]
    with pytest.raises(ValueError):
        Backoff(0.0)


def test_client_start_backs_off_and_says_so_once(caplog):
    """A registry that is not there: tries at 1, 2, 4, ... 30, 30 s, one warning (not one per try), and one info
    line when it finally answers."""
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        transport = RecordingTransport(httpx.ASGITransport(app=app), fail_first=8)
        clock = FakeClock()
        sleep = StepSleep(clock)
        info = InstanceInfo(instance_id=new_instance_id(), role="language", address="127.0.0.1:7004")
        client = BootstrapClient("127.0.0.1:1", info, heartbeat_interval=1.0, transport=transport,
                                 sleep=sleep, clock=clock, rng=lambda: 0.0)
        with caplog.at_level(logging.DEBUG, logger="vlserve.disagg.bootstrap"):
            await client.start()
            await client.stop(deregister=False)
        assert sleep.delays[:8] == [1, 2, 4, 8, 16, 30, 30, 30]
        assert client.registrations == 1
        assert _records(caplog, logging.WARNING) == [
            "registry at 127.0.0.1:1 unreachable (ConnectError: connection refused); retrying with backoff up to 30s"]
        infos = _records(caplog, logging.INFO)
        assert len(infos) == 1 and infos[0].startswith(f"registered {info.instance_id} (language, 127.0.0.1:7004)"
                                                       " with the registry at 127.0.0.1:1")
        assert infos[0].endswith("(it was unreachable for 121s, 8 failed tries)")
        assert len(_records(caplog, logging.DEBUG)) == 7  # the other tries, for whoever asks
        assert all(r.exc_info is None for r in caplog.records)
    asyncio.run(main())


def test_client_reminds_only_every_few_minutes_while_the_registry_stays_away(caplog):
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        transport = RecordingTransport(httpx.ASGITransport(app=app), fail_first=40)  # 1+2+...+16 + 35*30 s
        clock = FakeClock()
        client = BootstrapClient("registry:8998", InstanceInfo(new_instance_id(), "encode", "127.0.0.1:7005"),
                                 transport=transport, sleep=StepSleep(clock), clock=clock, rng=lambda: 0.0,
                                 remind_every=300.0)
        with caplog.at_level(logging.WARNING, logger="vlserve.disagg.bootstrap"):
            await client.start()
            await client.stop(deregister=False)
        warnings = _records(caplog, logging.WARNING)
        # First try at t=0, then reminders at the first tries at least 300 s after the last line: t=301, 601, 901.
        assert len(warnings) == 4
        assert "still unreachable after 301s and 15 tries" in warnings[1]
    asyncio.run(main())


def test_heartbeats_keep_their_interval_and_back_off_only_while_the_registry_is_away(caplog):
    async def main():
        app = build_bootstrap_app(heartbeat_interval=1.0, clock=FakeClock())
        transport = RecordingTransport(httpx.ASGITransport(app=app))
        clock = FakeClock()
        sleep = StepSleep(clock, manual=True)
        info = InstanceInfo(instance_id=new_instance_id(), role="encode", address="127.0.0.1:7006")
        client = BootstrapClient("registry:8998", info, heartbeat_interval=1.0, transport=transport,
                                 sleep=sleep, clock=clock, rng=lambda: 0.0)
        with caplog.at_level(logging.INFO, logger="vlserve.disagg.bootstrap"):
            await client.start()
            await _wait_for(lambda: len(sleep.delays) == 1)
            await sleep.step(3)
            assert sleep.delays == [1, 1, 1, 1]  # registered: the normal interval
            assert transport.calls.count(("/heartbeat", 200)) == 3

            transport.fail_first = 4  # the registry goes away...
            app.state.instances.clear()  # ...and comes back empty, like a restart
            await sleep.step(6)
            assert sleep.delays[4:] == [1, 2, 4, 8, 1, 1]  # backing off, then the normal interval again
            assert client.registrations == 2 and info.instance_id in app.state.instances
            await client.stop()
        warnings = _records(caplog, logging.WARNING)
        assert len(warnings) == 1 and warnings[0].startswith("registry at registry:8998 unreachable (ConnectError")
        infos = _records(caplog, logging.INFO)
        assert len(infos) == 2  # registered, and registered again after the outage: nothing per try
        assert infos[1].endswith("(it was unreachable for 15s, 4 failed tries)")
    asyncio.run(main())


def test_client_refused_registration_raises():
    async def main():
        app = build_bootstrap_app(clock=FakeClock())
        info = InstanceInfo(instance_id=new_instance_id(), role="decoder", address="127.0.0.1:7003")
        client = BootstrapClient("registry", info, transport=httpx.ASGITransport(app=app))
        with pytest.raises(ValueError, match="refused"):
            await client.start()
        await client.stop(deregister=False)
    asyncio.run(main())


def test_real_bootstrap_process():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vlserve", "bootstrap", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, f"{base}/health", 20, "registry", lambda: proc.stdout.read().decode())
        r = HTTP.post(f"{base}/register", json=_reg("real-1", role="language", address="127.0.0.1:9000"))
        assert r.status_code == 200 and r.json()["heartbeat_interval"] == 1.0
        assert _ids(HTTP.get(f"{base}/instances", params={"role": "language"})) == ["real-1"]
        assert HTTP.post(f"{base}/heartbeat", json={"instance_id": "real-1", "load": 2}).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode in (0, -15)


def test_language_side_says_once_that_it_cannot_list_peers(caplog):
    """The language server lists its encoders every heartbeat: a registry outage is one warning, not one a second."""
    from types import SimpleNamespace

    from vlserve.disagg.peer_client import PeerClient

    calls = []

    async def refresh():
        calls.append(1)
        if len(calls) == 8:
            raise asyncio.CancelledError  # end the loop
        if len(calls) in (4, 5):
            return  # the registry came back for a while
        raise httpx.ConnectError("connection refused")

    async def no_change(timeout):  # the bootstrap registry has no watch: the loop lists every interval
        await asyncio.sleep(timeout)

    fake = SimpleNamespace(opts=SimpleNamespace(heartbeat_interval=0.001), quarantined={}, _refresh=refresh,
                           kind=SimpleNamespace(role="encode"), conns={},
                           registry=SimpleNamespace(wait_for_change=no_change))
    with caplog.at_level(logging.DEBUG, logger="vlserve.disagg"):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(PeerClient._refresh_loop(fake))
    failures = [r for r in caplog.records if "could not list encode instances" in r.getMessage()]
    assert len(failures) == 5  # tries 1-3 and 6-7 failed
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG, logging.DEBUG,
                                             logging.WARNING, logging.DEBUG]
