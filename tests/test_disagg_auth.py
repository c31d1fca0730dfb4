"""Peers of a disaggregated deployment must hold the shared secret: signed registry calls, CurveZMQ data channel,
and open channels refused off loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq
import zmq.asyncio

from vlserve.core.errors import InvalidInputError
from vlserve.disagg.auth import HEADER, PeerAuth, require_secret_off_loopback
from vlserve.disagg.bootstrap import (OPEN_CHECK_HEADER, BootstrapClient, InstanceInfo, build_bootstrap_app,
                                     new_instance_id)

SECRET = "correct horse battery staple"


def test_signatures_check_secret_body_path_and_age():
    auth = PeerAuth(SECRET)
    headers = auth.sign("POST", "/register", b"{}", now=1000.0)
    assert auth.verify("POST", "/register", b"{}", headers[HEADER], now=1010.0)
    assert not auth.verify("POST", "/register", b"{ }", headers[HEADER], now=1010.0)  # body changed
    assert not auth.verify("POST", "/heartbeat", b"{}", headers[HEADER], now=1010.0)  # path changed
    assert not auth.verify("POST", "/register", b"{}", headers[HEADER], now=2000.0)  # replayed much later
    assert not PeerAuth("other").verify("POST", "/register", b"{}", headers[HEADER], now=1010.0)
    assert not auth.verify("POST", "/register", b"{}", None) and not auth.verify("POST", "/register", b"{}", "x:y")
    assert PeerAuth(None).verify("POST", "/register", b"{}", None)  # no secret: open


def _client(app, auth: PeerAuth | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://registry")


def test_registry_refuses_unsigned_and_forged_calls():
    app = build_bootstrap_app(auth=PeerAuth(SECRET))
    info = {"instance_id": "rogue", "role": "encode", "address": "10.9.9.9:1"}

    async def run():
        async with _client(app) as c:
            assert (await c.post("/register", json=info)).status_code == 401
            forged = PeerAuth("guess").sign("POST", "/register", b"{}")
            assert (await c.post("/register", content=b"{}", headers=forged)).status_code == 401
            assert (await c.get("/instances")).status_code == 401  # nobody may even list the members
            # a router's check that the registry refuses unsigned calls is refused too, quietly (debug log)
            assert (await c.get("/instances", headers={OPEN_CHECK_HEADER: "1"})).status_code == 401
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).status_code == 200  # probes need no secret
        # The real client with the secret registers; with another secret it is refused.
        good = BootstrapClient("http://registry", InstanceInfo(new_instance_id(), "encode", "10.0.0.1:5"),
                               transport=httpx.ASGITransport(app=app), auth=PeerAuth(SECRET))
        await good.start()
        assert [i.role for i in await good.list_instances()] == ["encode"]
        await good.stop()
        bad = BootstrapClient("http://registry", InstanceInfo(new_instance_id(), "encode", "10.0.0.2:5"),
                              transport=httpx.ASGITransport(app=app), auth=PeerAuth("wrong"))
        with pytest.raises(ValueError, match="401"):
            await bad.start()
        await bad.stop(deregister=False)

    asyncio.run(run())


def test_data_channel_talks_only_to_secret_holders():
    """A ROUTER secured like an encoder's: the right key gets answers, a wrong or missing one gets nothing."""
    async def run():
        ctx = zmq.asyncio.Context()
        server_auth = PeerAuth(SECRET)
        router = ctx.socket(zmq.ROUTER)
        server_auth.secure_server(router)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def echo():
            while True:
                peer, msg = await router.recv_multipart()
                await router.send_multipart([peer, b"pong:" + msg])

        task = asyncio.create_task(echo())

        async def ask(auth: PeerAuth) -> bytes | None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            auth.secure_client(sock)
            sock.connect(f"tcp://127.0.0.1:{port}")
            await sock.send(b"ping")
            try:
                return await asyncio.wait_for(sock.recv(), 1.5) if await sock.poll(1500) else None
            finally:
                sock.close()

        try:
            assert await ask(PeerAuth(SECRET)) == b"pong:ping"
            assert await ask(PeerAuth("not the secret")) is None
            assert await ask(PeerAuth(None)) is None  # plaintext client against a CURVE server
        finally:
            task.cancel()
            router.close()
            server_auth.stop()
            ctx.term()

    asyncio.run(run())


def test_open_channels_only_on_loopback():
    require_secret_off_loopback(PeerAuth(None), "127.0.0.1", "x")
    require_secret_off_loopback(PeerAuth(None), "localhost", "x")
    require_secret_off_loopback(PeerAuth(SECRET), "0.0.0.0", "x")
    for host in ("0.0.0.0", "10.1.2.3", "example.com", "::"):
        with pytest.raises(InvalidInputError, match="disagg-secret"):
            require_secret_off_loopback(PeerAuth(None), host, "x")


def test_a_routers_open_registry_check_warns_no_one_and_finds_an_open_registry_open(caplog, monkeypatch):
    """The router checks the registry refuses unsigned calls (at start and every 30 s): the signed registry
    refuses it without the warning a stranger's call gets; an open one answers it, so the router still finds it
    open (its own --disagg-secret proves nothing about the registry)."""
    from vlserve.router.app import bootstrap_open

    real = httpx.AsyncClient

    def check(app) -> str:  # the router's probe, sent to the app in this process
        monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.ASGITransport(app=app), **kw))
        return asyncio.run(bootstrap_open("http://registry"))

    with caplog.at_level("DEBUG", logger="vlserve.disagg.bootstrap"):
        assert check(build_bootstrap_app(auth=PeerAuth(SECRET))) == ""
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "router's unsigned check" in caplog.text
    assert "answers unsigned calls" in check(build_bootstrap_app(auth=PeerAuth(None)))
