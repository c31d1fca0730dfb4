"""The etcd registry against a real etcd server: joins and leaves seen through the watch, leases that run out,
an etcd restarted on its data dir or wiped, compaction, user/password auth with expiring tokens, TLS; and the
choice between the embedded bootstrap and etcd by URL."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest

from tests.etcd_server import EtcdServer, etcd, needs_etcd  # noqa: F401 (etcd is a fixture)
from tests.server_utils import HTTP
from vlserve.core.config import DisaggArgs
from vlserve.core.errors import ConfigurationError, InvalidInputError
from vlserve.disagg.bootstrap import BootstrapClient
from vlserve.disagg.etcd_client import EtcdClient, EtcdCredentials, EtcdError, WatchCompacted
from vlserve.disagg.etcd_registry import EtcdRegistry
from vlserve.disagg.registry import (
    InstanceInfo,
    advertised_host,
    lease_ttl,
    new_instance_id,
    parse_registry_url,
)
from vlserve.disagg.registries import open_registry

TTL = 2  # seconds: etcd's smallest lease (it grants at least this)


def _registry(server: EtcdServer, role: str = "encode", namespace: str = "m", creds=None, load_fn=None,
              endpoints=None, heartbeat_interval: float = 0.3) -> EtcdRegistry:
    info = InstanceInfo(new_instance_id(), role, f"10.0.0.{hash(role) % 200}:5555")
    client = EtcdClient(endpoints or [server.endpoint], creds)
    return EtcdRegistry(client, info, namespace, TTL, heartbeat_interval=heartbeat_interval, load_fn=load_fn)


async def _until(predicate, timeout: float, what: str) -> float:
    """Seconds until an async predicate holds; fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await predicate():
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


async def _ids(reg: EtcdRegistry, role=None) -> set[str]:
    return {i.instance_id for i in await reg.list_instances(role)}


# ---- URLs and the choice of implementation ------------------------------------------------------------------------
def test_registry_urls_parse_or_say_what_is_expected():
    t = parse_registry_url("etcd://10.0.0.5:2379,etcd-1.etcd:2379")
    assert (t.kind, t.endpoints, t.host) == ("etcd", ("http://10.0.0.5:2379", "http://etcd-1.etcd:2379"), "10.0.0.5")
    assert parse_registry_url("etcds://etcd:2379").endpoints == ("https://etcd:2379",)
    assert parse_registry_url("127.0.0.1:8998") == parse_registry_url("http://127.0.0.1:8998")
    assert parse_registry_url("127.0.0.1:8998").kind == "bootstrap"
    for bad, says in [("redis://h:1", "scheme"), ("etcd://", "HOST:PORT"), ("etcd://h", "HOST:PORT"),
                      ("etcd://user:pw@h:2379", "VLSERVE_REGISTRY_PASSWORD"), ("etcd://h:99999", "not a port"),
                      ("http://a:1,b:2", "one address"), ("etcd://h:2379/v3", "HOST:PORT")]:
        with pytest.raises(InvalidInputError, match=says):
            parse_registry_url(bad)


def test_open_registry_follows_the_url_and_namespaces_by_model():
    info = InstanceInfo(new_instance_id(), "encode", "10.0.0.1:1")
    boot = open_registry(DisaggArgs(bootstrap="127.0.0.1:9"), info, "/models/Qwen2-VL")
    assert isinstance(boot, BootstrapClient) and boot.url == "http://127.0.0.1:9"
    opts = DisaggArgs(registry="etcd://127.0.0.1:1,127.0.0.1:2", heartbeat_interval=0.5, heartbeat_failure_threshold=5)
    reg = open_registry(opts, info, "/models/Qwen2-VL")
    assert isinstance(reg, EtcdRegistry) and reg.client.endpoints == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    # The model is one key segment (its slashes quoted), so no deployment's prefix is another's.
    assert reg.key == f"/vlserve/%2Fmodels%2FQwen2-VL/encode/{info.instance_id}"
    assert reg.ttl == lease_ttl(opts) == 3
    named = open_registry(DisaggArgs(registry="etcd://h:1", registry_namespace="prod"), info, "/models/x")
    assert named.prefix == "/vlserve/prod/"
    with pytest.raises(InvalidInputError, match="VLSERVE_REGISTRY_PASSWORD"):
        open_registry(DisaggArgs(registry="etcd://h:1", registry_user="root"), info, "m")
    with pytest.raises(InvalidInputError, match="--registry-key"):
        open_registry(DisaggArgs(registry="etcd://h:1", registry_cert="c.pem"), info, "m")


def test_the_advertised_host_is_the_flag_or_a_concrete_address():
    assert advertised_host(DisaggArgs(advertise_host="10.1.2.3"), "0.0.0.0") == "10.1.2.3"
    assert advertised_host(DisaggArgs(), "127.0.0.1") == "127.0.0.1"
    # A wildcard bind names no host: the interface toward the registry does.
    assert advertised_host(DisaggArgs(registry="etcd://127.0.0.1:2379"), "0.0.0.0") == "127.0.0.1"


# ---- against a real etcd ------------------------------------------------------------------------------------------
@needs_etcd
def test_instances_see_joins_and_leaves_through_the_watch(etcd):  # noqa: F811
    async def main():
        load = {"n": 0}
        a = _registry(etcd, "language")
        b = _registry(etcd, "encode", load_fn=lambda: load["n"])
        other_model = _registry(etcd, "encode", namespace="another-model")
        await a.start()
        await other_model.start()
        assert await _ids(a) == {a.info.instance_id}  # another model's encoder is not ours
        await a.wait_for_change(0.3)  # takes the news of a's own listing (and another model's join: no news)
        t0 = time.monotonic()
        await b.start()
        await a.wait_for_change(5.0)  # the watch wakes it: no polling interval to wait out
        assert time.monotonic() - t0 < 1.5
        # The view is only ever updated by the watch: b listed means the watch delivered it.
        await _until(lambda: _has(a, b.info.instance_id), 1.0, "b listed")
        assert await _ids(a, "encode") == {b.info.instance_id}
        load["n"] = 7  # the load is put again with the next keep-alive
        await _until(lambda: _load_of(a, b.info.instance_id, 7), 3.0, "the new load listed")
        await b.stop()  # revokes its lease: gone at once, not after the TTL
        await _until(lambda: _gone(a, b.info.instance_id), 1.0, "a leave seen at once")
        await a.stop()
        await other_model.stop()
    asyncio.run(main())


async def _load_of(reg, iid, load) -> bool:
    return any(i.instance_id == iid and i.load == load for i in await reg.list_instances())


async def _gone(reg, iid) -> bool:
    return iid not in await _ids(reg)


@needs_etcd
def test_a_dead_instance_leaves_when_its_lease_runs_out(etcd):  # noqa: F811
    async def main():
        a, dead = _registry(etcd, "language"), _registry(etcd, "encode")
        await a.start()
        await dead.start()
        await _until(lambda: _has(a, dead.info.instance_id), 2.0, "the encoder listed")
        await dead.stop(deregister=False)  # no more keep-alives, no revoke: as if the process were killed
        took = await _until(lambda: _gone(a, dead.info.instance_id), TTL + 3.0, "the dead encoder dropped")
        assert took > 0.5  # it stayed for (most of) its lease
        await a.stop()
    asyncio.run(main())


async def _has(reg, iid) -> bool:
    return iid in await _ids(reg)


@needs_etcd
def test_etcd_restarted_on_its_data_dir_keeps_everyone_and_the_watch_resumes(etcd):  # noqa: F811
    async def main():
        a, b = _registry(etcd, "language"), _registry(etcd, "encode")
        await a.start()
        await b.start()
        etcd.kill()
        await asyncio.sleep(1.0)  # keep-alives and the watch fail meanwhile
        etcd.start()
        await _until(lambda: _has(a, b.info.instance_id), 10.0, "b listed after the restart")
        late = _registry(etcd, "encode")
        await late.start()  # a join after the restart reaches a through its re-established watch
        await _until(lambda: _has(a, late.info.instance_id), 10.0, "a join after the restart seen")
        await asyncio.sleep(TTL + 0.5)  # and nobody's lease ran out meanwhile
        assert await _ids(a) == {a.info.instance_id, b.info.instance_id, late.info.instance_id}
        for r in (a, b, late):
            await r.stop()
    asyncio.run(main())


@needs_etcd
def test_the_watch_is_back_when_the_keepalives_are_not_after_its_backoff(etcd):  # noqa: F811
    """A watch broken by an outage retries with a backoff that grows with it (here it starts at 10 s: the
    heartbeat interval); once etcd is back and the keep-alives (every TTL/3) get through, it retries at once, so a
    join right after the restart is seen in seconds, not after the backoff."""
    async def main():
        a = _registry(etcd, "language", heartbeat_interval=10.0)
        await a.start()
        await _until(lambda: _has(a, a.info.instance_id), 2.0, "a listed")
        await asyncio.sleep(0.3)  # its watch is up
        etcd.kill()  # the watch breaks now and waits 10 s before its next try
        await asyncio.sleep(0.5)
        etcd.start()
        late = _registry(etcd, "encode")
        await late.start()
        await _until(lambda: _has(a, late.info.instance_id), 4.0, "a join after the restart seen")
        for r in (a, late):
            await r.stop()
    asyncio.run(main())


@needs_etcd
def test_a_wiped_etcd_gets_everyone_registered_again_without_a_restart(tmp_path):
    first = EtcdServer(tmp_path / "first").start()
    try:
        async def main():
            a, b = _registry(first, "language"), _registry(first, "encode")
            await a.start()
            await b.start()
            first.kill()
            shutil.rmtree(first.data_dir)  # a new, empty etcd on the same address: every lease is unknown
            first.start()
            probe = EtcdClient([first.endpoint])

            async def both_in_etcd() -> bool:  # what etcd holds now, not a view that may be stale
                keys = {k for k, _ in (await probe.get_prefix("/vlserve/m/"))[1]}
                # A registration counts once its put has answered, which may come after etcd shows the key.
                return keys == {a.key, b.key} and a.registrations == b.registrations == 2
            await _until(both_in_etcd, 15.0, "both registered again, once each")
            await _until(lambda: _has(a, b.info.instance_id), 15.0, "b listed by a")
            await _until(lambda: _has(b, a.info.instance_id), 15.0, "a listed by b")
            await probe.aclose()
            for r in (a, b):
                await r.stop()
        asyncio.run(main())
    finally:
        first.kill()


@needs_etcd
def test_a_watch_from_a_compacted_revision_says_so(etcd):  # noqa: F811
    async def main():
        client = EtcdClient([etcd.endpoint])
        for i in range(3):
            rev = await client.put(f"/vlserve/c/encode/{i}", b"{}")
        await client._call("/v3/kv/compaction", {"revision": rev})
        with pytest.raises(WatchCompacted):
            async for _ in client.watch_prefix("/vlserve/c/", 1):
                pass
        # The registry lists again and watches from there: it still sees new joins.
        a = _registry(etcd, "language", namespace="c")
        await a.start()
        b = _registry(etcd, "encode", namespace="c")
        await b.start()
        await _until(lambda: _has(a, b.info.instance_id), 3.0, "a join seen")
        for r in (a, b):
            await r.stop()
        await client.aclose()
    asyncio.run(main())


@needs_etcd
def test_the_next_endpoint_answers_when_the_first_is_down(etcd):  # noqa: F811
    async def main():
        dead = "http://127.0.0.1:1"
        a = _registry(etcd, "language", endpoints=[dead, etcd.endpoint])
        await a.start()
        assert a.client.endpoint == etcd.endpoint
        assert await _ids(a) == {a.info.instance_id}
        await a.stop()
    asyncio.run(main())


def _enable_auth(endpoint: str, password: str) -> None:
    for path, body in [("/v3/auth/user/add", {"name": "root", "password": password}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/enable", {})]:
        resp = HTTP.post(f"{endpoint}{path}", json=body, timeout=5)
        assert resp.status_code == 200, resp.text


@needs_etcd
def test_user_and_password_with_tokens_that_expire(tmp_path):
    # Tokens live one second here: the keep-alives must re-authenticate several times over.
    server = EtcdServer(tmp_path / "auth", extra_args=("--auth-token-ttl", "1")).start()
    try:
        _enable_auth(server.endpoint, "s3cret")

        async def main():
            good = EtcdCredentials("root", "s3cret")
            a, b = _registry(server, "language", creds=good), _registry(server, "encode", creds=good)
            await a.start()
            await b.start()
            await asyncio.sleep(3.5)
            assert await _ids(a) == {a.info.instance_id, b.info.instance_id}
            assert a.registrations == b.registrations == 1  # the lease never lapsed
            late = _registry(server, "encode", creds=good)
            await late.start()
            await _until(lambda: _has(a, late.info.instance_id), 3.0, "a join seen by an authenticated watch")
            for creds, says in [(None, "user name is empty|permission denied|invalid auth token"),
                                (EtcdCredentials("root", "wrong"), "authentication failed")]:
                with pytest.raises(ConfigurationError, match=says):  # exits 78: a restart would not help
                    await _registry(server, "encode", creds=creds).start()
            for r in (a, b, late):
                await r.stop()
        asyncio.run(main())
    finally:
        server.kill()


def _make_certs(folder) -> dict:
    """A CA and a server certificate for 127.0.0.1 (openssl), and a client certificate from the same CA."""
    run = lambda *a: subprocess.run(a, cwd=folder, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    # etcd's JSON gateway dials its own gRPC port with the server certificate: it must be good for clients too.
    for name, ext in [("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")]:
        (folder / f"{name}.ext").write_text(ext + "\n")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return {n: str(folder / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@needs_etcd
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make test certificates")
def test_tls_with_a_client_certificate(tmp_path):
    certs = tmp_path / "certs"
    certs.mkdir()
    c = _make_certs(certs)
    server = EtcdServer(tmp_path / "tls", scheme="https",
                        extra_args=("--cert-file", c["server.pem"], "--key-file", c["server.key"],
                                    "--client-cert-auth", "--trusted-ca-file", c["ca.pem"]))
    server.start(wait=False)
    try:
        server.wait_ready(verify=EtcdCredentials(ca_file=c["ca.pem"], cert_file=c["client.pem"],
                                                 key_file=c["client.key"]).ssl_context())

        async def main():
            opts = DisaggArgs(registry=server.url, registry_ca=c["ca.pem"], registry_cert=c["client.pem"],
                              registry_key=c["client.key"], heartbeat_interval=0.5)
            a = open_registry(opts, InstanceInfo(new_instance_id(), "encode", "10.0.0.1:1"), "m")
            await a.start()
            assert await _ids(a) == {a.info.instance_id}
            await a.stop()
            # Without the client certificate etcd refuses the connection.
            bare = EtcdClient([server.endpoint], EtcdCredentials(ca_file=c["ca.pem"]))
            with pytest.raises(EtcdError):
                await bare.grant(TTL)
            await bare.aclose()
        asyncio.run(main())
    finally:
        server.kill()
