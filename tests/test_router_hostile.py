"""The router against replicas that misbehave (issue #43, the hostile probe's router findings), in process: the
real router app and `ReplicaSet` over a stand-in registry listing small HTTP servers on loopback that answer as
each test says.

- An answer is read within `--max-replica-response-bytes`: one over it is cut off there (502), never held whole.
- A replica that takes a request and goes silent gets `--replica-read-timeout` (504, or an error event
  mid-stream) and is avoided: the next requests go elsewhere.
- What comes back is checked: JSON (it must parse, an object) or an SSE stream; anything else is 502; a replica's
  plain-text error becomes the server's error JSON with its status.
- The client's `Authorization` never goes upstream: replicas get the router's own credential; an unsigned
  registry (anyone local could register as a replica) is refused unless `--allow-unsigned-replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from vlserve.cli import build_parser
from vlserve.core.config import ROUTER
from vlserve.core.errors import InvalidInputError
from vlserve.core.options import options_from
from vlserve.disagg.registry import InstanceInfo
from vlserve.router.app import build_router_app, open_replicas
from vlserve.router.replicas import ReplicaSet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
HANG_GUARD_S = 60  # a router that never answers fails the test here instead of at pytest's timeout


# ---- replicas that answer as told -------------------------------------------------------------------------
class FakeReplica:
    """An HTTP/1.1 server on loopback: reads each request (its headers kept in `.requests`), then `behave`s."""

    def __init__(self, behave):
        self.behave, self.requests, self.sent = behave, [], 0
        self.hung_up = asyncio.Event()  # the router closed the connection while we still had more to send

    async def start(self) -> FakeReplica:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
            await reader.readexactly(int(headers.get("content-length", 0)))
            self.requests.append(headers)
            await self.behave(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.hung_up.set()
        finally:
            writer.close()

    async def send(self, writer, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


def head(status: int = 200, content_type: str | None = "application/json", length: int | None = None,
         extra: str = "") -> bytes:
    lines = [f"HTTP/1.1 {status} X"]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines.append(f"content-length: {length}" if length is not None else "connection: close")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def answer(status: int, content_type: str | None, body: bytes, extra: str = ""):
    async def behave(fake, reader, writer):
        await fake.send(writer, head(status, content_type, len(body), extra) + body)
    return behave


def endless_json(total: int):
    """A JSON answer with no length, `total` bytes of it (it would be valid if it ever ended)."""
    async def behave(fake, reader, writer):
        await fake.send(writer, head() + b'{"pad": "')
        while fake.sent < total:
            await fake.send(writer, b"x" * 65536)
        await fake.send(writer, b'"}')
    return behave


async def silent(fake, reader, writer):
    await reader.read()  # takes the request, never answers; returns when the router hangs up


async def one_event_then_silent(fake, reader, writer):
    await fake.send(writer, head(200, "text/event-stream") + b'data: {"choices": []}\n\n')
    await reader.read()


# ---- the router around them -------------------------------------------------------------------------------
class FakeRegistry:
    def __init__(self, infos: list[InstanceInfo]):
        self.infos = infos

    async def list_instances(self, role: str | None = None) -> list[InstanceInfo]:
        return [i for i in self.infos if role in (None, i.role)]

    async def stop(self, deregister: bool = True) -> None:
        pass


def router_options(*flags: str):
    ns = build_parser().parse_args(["router", "--model", "m", "--routing", "round-robin", *flags])
    return options_from(ns, ROUTER)


@contextlib.asynccontextmanager
async def router(behaviours: list, *flags: str, chat=None):
    """(client of the router app, the fake replicas by instance id, the ReplicaSet). `chat`: the prompt hasher's
    (block hashes, whole) for a chat request, for cache-aware routing."""
    fakes = [await FakeReplica(b).start() for b in behaviours]
    infos = [InstanceInfo(f"r{i}", "serve", "", f"127.0.0.1:{f.port}") for i, f in enumerate(fakes)]
    replicas = ReplicaSet(FakeRegistry(infos), ("serve",), 60.0)
    await replicas.refresh()
    hasher = SimpleNamespace(executor=ThreadPoolExecutor(1), chat=chat, completion=None,
                             cfg=SimpleNamespace(max_model_len=1024, limit_mm_per_prompt={"image": 1}))
    app = build_router_app(router_options(*flags), hasher, replicas)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None) as client:
            yield client, {f"r{i}": f for i, f in enumerate(fakes)}, replicas
    finally:
        await replicas.stop()
        hasher.executor.shutdown()
        for f in fakes:
            await f.close()


def run(scenario):
    async def guarded():
        async with asyncio.timeout(HANG_GUARD_S):
            return await scenario()
    return asyncio.run(guarded())


def error_of(resp: httpx.Response) -> str:
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    return resp.json()["error"]["message"]


# ---- 1. bounded answers -----------------------------------------------------------------------------------
def test_an_answer_over_the_bound_is_cut_off_there_not_held():
    total, limit = 32 * 2**20, 2**20

    async def scenario():
        async with router([endless_json(total)], "--max-replica-response-bytes", str(limit)) as (client, fakes, _):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 502, resp.text[:200]
            assert "--max-replica-response-bytes" in error_of(resp)
            await fakes["r0"].hung_up.wait()  # the router stopped reading: the rest was never sent
            assert fakes["r0"].sent < total
    run(scenario)


def test_a_declared_length_over_the_bound_is_refused_before_reading():
    async def declares_too_much(fake, reader, writer):
        await fake.send(writer, head(200, "application/json", 10**12) + b'{"a": ')
        await reader.read()

    async def scenario():
        async with router([declares_too_much], "--max-replica-response-bytes", "1000") as (client, _, __):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 502 and "--max-replica-response-bytes" in error_of(resp)
    run(scenario)


def test_a_large_answer_within_the_bound_passes_whole():
    big = json.dumps({**ANSWER, "pad": "y" * (3 * 2**20)}).encode()  # parsed off the event loop

    async def scenario():
        async with router([answer(200, "application/json", big)], "--max-replica-response-bytes",
                          str(4 * 2**20)) as (client, _, __):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200 and resp.content == big
    run(scenario)


# ---- 2. a silent replica ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def avoid_long(monkeypatch):
    """An avoided replica stays avoided for the whole test, however slow the machine."""
    monkeypatch.setattr("vlserve.router.replicas.AVOID_S", 3600.0)


def test_a_silent_replica_times_out_and_is_avoided():
    ok = answer(200, "application/json", json.dumps(ANSWER).encode())

    async def scenario():
        async with router([silent, ok], "--replica-read-timeout", "0.3") as (client, fakes, replicas):
            statuses = []
            for _ in range(4):
                resp = await client.post("/v1/chat/completions", json=CHAT)
                statuses.append(resp.status_code)
                if resp.status_code == 504:
                    assert "--replica-read-timeout" in error_of(resp)
            assert statuses.count(504) == 1 and statuses.count(200) == 3, statuses
            assert len(fakes["r0"].requests) == 1 and len(fakes["r1"].requests) == 3
            assert replicas.replicas["r0"].avoid_until > time.monotonic()
            assert replicas.replicas["r0"].in_flight == 0
    run(scenario)


def test_a_stream_that_goes_silent_ends_with_an_error_event_and_the_replica_is_avoided():
    async def scenario():
        async with router([one_event_then_silent], "--replica-read-timeout", "0.3") as (client, _, replicas):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert resp.status_code == 200
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[0] == '{"choices": []}' and events[-1] == "[DONE]", events
            error = json.loads(events[-2])["error"]
            assert error["code"] == 504 and "--replica-read-timeout" in error["message"]
            assert replicas.replicas["r0"].avoid_until > time.monotonic()
            assert replicas.replicas["r0"].in_flight == 0
    run(scenario)


# ---- 3. what comes back is checked ------------------------------------------------------------------------
@pytest.mark.parametrize("status, content_type, body, extra, expected", [
    (200, "text/html", b"<script>alert(1)</script>", "", 502),
    (200, "application/json", b'{"choices": [', "", 502),
    (200, "application/json", b"[1, 2]", "", 502),
    (200, "application/json; charset=utf-8", b'{"a": "\xff"}', "", 502),
    (200, None, b'{"a": 1}', "", 502),
    (200, "application/json", b"\x1f\x8b\x08\x00", "content-encoding: gzip\r\n", 502),
    (302, "application/json", b"{}", "location: http://evil.example/\r\n", 502),
    (200, "text/plain", b"all fine", "", 502),
])
def test_a_replica_answer_that_is_not_json_or_sse_is_refused(status, content_type, body, extra, expected):
    async def scenario():
        async with router([answer(status, content_type, body, extra)]) as (client, _, __):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == expected
            assert "the replica" in error_of(resp)
            assert b"<script>" not in resp.content
    run(scenario)


def test_a_replicas_errors_keep_their_status_and_json():
    error = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}).encode()

    async def scenario():
        async with router([answer(400, "application/json", error)]) as (client, _, __):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 400 and resp.content == error
        # uvicorn's own plain-text errors (a 503 under --limit-concurrency, a 500) become the error JSON
        async with router([answer(503, "text/plain; charset=utf-8", b"Service <b>Unavailable</b>")]) as (
                client, _, __):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503 and "Service <b>Unavailable</b>" in error_of(resp)
    run(scenario)


def test_a_stream_passes_through():
    events = b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\ndata: [DONE]\n\n'

    async def scenario():
        async with router([answer(200, "text/event-stream; charset=utf-8", events)]) as (client, _, replicas):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert resp.status_code == 200 and resp.content == events
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert replicas.replicas["r0"].in_flight == 0
    run(scenario)


# ---- 4. credentials ---------------------------------------------------------------------------------------
def test_the_clients_key_never_reaches_a_replica():
    ok = answer(200, "application/json", json.dumps(ANSWER).encode())
    client_key = {"authorization": "Bearer the-clients-own-key", "cookie": "session=1"}

    async def scenario():
        async with router([ok]) as (client, fakes, _):  # no key anywhere: nothing goes upstream
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=client_key)).status_code == 200
            seen = fakes["r0"].requests[-1]
            assert "authorization" not in seen and "cookie" not in seen
        async with router([ok], "--replica-api-key", "replicas-key") as (client, fakes, _):
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=client_key)).status_code == 200
            assert fakes["r0"].requests[-1]["authorization"] == "Bearer replicas-key"
        async with router([ok], "--api-key", "routers-key", "--replica-api-key", "replicas-key") as (
                client, fakes, _):
            resp = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={"authorization": "Bearer routers-key"})
            assert resp.status_code == 200
            assert fakes["r0"].requests[-1]["authorization"] == "Bearer replicas-key"
        async with router([ok], "--api-key", "routers-key") as (client, fakes, _):  # one key for every role
            resp = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={"authorization": "Bearer routers-key"})
            assert resp.status_code == 200
            assert fakes["r0"].requests[-1]["authorization"] == "Bearer routers-key"
        # replicas of an open registry may be anyone's: the key clients use on the router never goes there
        async with router([ok], "--api-key", "routers-key", "--allow-unsigned-replicas") as (client, fakes, _):
            resp = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={"authorization": "Bearer routers-key"})
            assert resp.status_code == 200
            assert "authorization" not in fakes["r0"].requests[-1]
    run(scenario)


def test_the_replica_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLSERVE_REPLICA_API_KEY", "from-env")
    assert router_options().disagg.replica_api_key == "from-env"


@pytest.mark.parametrize("flags, refused", [
    ([], True),
    (["--allow-unsigned-replicas"], False),
    (["--disagg-secret", "s3cret"], False),
    (["--registry", "etcd://127.0.0.1:2379"], True),
    (["--registry", "etcd://127.0.0.1:2379", "--allow-unsigned-replicas"], False),
    (["--registry", "etcd://127.0.0.1:2379", "--registry-user", "router", "--registry-password", "pw"], False),
])
def test_an_unsigned_registry_is_refused_unless_allowed(flags, refused):
    opts = router_options(*flags)
    if refused:
        with pytest.raises(InvalidInputError, match="--allow-unsigned-replicas"):
            open_replicas(opts)
        return

    async def opened():
        replicas = open_replicas(opts)
        await replicas.stop()
    asyncio.run(opened())


# ---- routing at low traffic (issue #43 §1), through the real proxy ------------------------------------------
def test_new_chats_one_at_a_time_spread_though_one_replica_holds_the_template():
    """The chat template cached on r0 only (it served first) must not pull every new chat there: the proxy tells
    the chooser which leading blocks other conversations share (before, every chat went to r0)."""
    from vlserve.core.kv_events import BlockStored, KVEventBatch

    template = [b"t1", b"t2", b"t3"]

    async def new_chat(body, adapter=None):  # each a new picture after the template: its hashes stop there
        return list(template), False

    async def scenario():
        async with router([answer(200, "application/json", json.dumps(ANSWER).encode())] * 2,
                          "--routing", "cache-aware", chat=new_chat) as (client, fakes, replicas):
            replicas.index.apply("r0", KVEventBatch("pub", 0, 0.0, [BlockStored(template, None, 16)]))
            for _ in range(4):
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200, resp.text
            return {name: len(f.requests) for name, f in fakes.items()}

    sent = run(scenario)
    assert min(sent.values()) >= 1, sent


def test_a_replicas_metrics_cannot_end_the_scrape_loop_or_be_held_whole():
    """`+Inf` once raised OverflowError out of the scrape, ending the loop that lists joins and leaves; a huge
    /metrics was read whole."""
    from vlserve.router.replicas import MAX_METRICS_BYTES, parse_load

    assert parse_load("vlserve:num_requests_running +Inf\nvlserve:num_requests_waiting NaN\n"
                      "vlserve:kv_cache_blocks -3\nvlserve:num_requests_running 2\n") == {
        "running": 2, "waiting": 0, "capacity": 0}

    async def huge(fake, reader, writer):
        await fake.send(writer, head(200, "text/plain"))
        while fake.sent < 16 * MAX_METRICS_BYTES:  # until the router hangs up (read whole, it would not)
            await fake.send(writer, b"# padding " + b"x" * 65536 + b"\n")

    async def scenario():
        async with router([huge]) as (client, fakes, replicas):
            await replicas.scrape()
            await asyncio.wait_for(fakes["r0"].hung_up.wait(), 30)
            return replicas.replicas["r0"].answering

    assert run(scenario) is False


@pytest.mark.parametrize("bootstrap_checks_signatures", [False, True])
def test_a_bootstrap_started_without_the_secret_is_found_out(bootstrap_checks_signatures):
    """The router's own --disagg-secret proves nothing about the registry: one that answers an unsigned call would
    take anyone's registration. Its replicas are not routed to (before, they were)."""
    from vlserve.disagg.auth import HEADER

    listing = json.dumps({"instances": [{"instance_id": "r0", "role": "serve", "address": "",
                                         "http_address": "127.0.0.1:9"}]}).encode()

    async def bootstrap(fake, reader, writer):
        signed = HEADER.lower() in fake.requests[-1]
        if bootstrap_checks_signatures and not signed:
            await fake.send(writer, head(401, "application/json", 2) + b"{}")
        else:
            await fake.send(writer, head(200, "application/json", len(listing)) + listing)

    async def scenario():
        fake = await FakeReplica(bootstrap).start()
        replicas = open_replicas(router_options("--bootstrap", f"127.0.0.1:{fake.port}", "--disagg-secret", "s3"))
        try:
            await replicas.refresh()
            return replicas.refused, list(replicas.replicas)
        finally:
            await replicas.stop()
            await fake.close()

    refused, listed = run(scenario)
    if bootstrap_checks_signatures:
        assert (refused, listed) == ("", ["r0"])
    else:
        assert "--disagg-secret" in refused and listed == []


def test_an_answer_that_opens_after_its_client_left_is_closed():
    """The client left just as the replica's answer opened: that response is closed, not left generating."""
    from vlserve.server.serving import _close_abandoned

    class Opened:
        closed = False

        async def aclose(self):
            self.closed = True

    async def scenario():
        opened = Opened()
        done = asyncio.get_running_loop().create_future()
        done.set_result(opened)
        _close_abandoned(done)
        await asyncio.sleep(0)
        return opened.closed

    assert run(scenario)
