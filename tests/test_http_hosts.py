"""Host names and redirects on the OpenAI server and the router (issue #43, the hostile probe's minor findings):

- only the names a server is reached by are answered (DNS rebinding: a page that rebinds its own name to this
  address cannot use the playground or /v1), `--allowed-hosts` adds names, `*` any; 400 otherwise;
- trailing-slash redirects are relative: the request's Host is never sent back in a Location;
- `/metrics` stays open under `--api-key` (as vLLM's: for Prometheus scrapers; it holds counts, no prompts).

The apps around stand-ins first (no model), then the real `serve` and `router` processes, which wrap their apps in
the Host check (TestClient's "testserver" is no name a real server answers to).
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace as NS

import pytest
from fastapi.testclient import TestClient

from vlserve.cli import build_parser
from vlserve.core.config import ROUTER, SERVE
from vlserve.core.errors import InvalidInputError
from vlserve.core.options import options_from
from vlserve.router.app import build_router_app, run_router
from vlserve.router.replicas import ReplicaSet
from vlserve.server.api_server import build_app, serve
from vlserve.server.hosts import HostCheck, HostPolicy, host_name
from tests.server_utils import HTTP

KEY = "the-key"
MACHINE = socket.gethostname().lower()


def options(role: str, *flags: str):
    args = [role, "--model", "m", *flags]
    if role == ROUTER:
        args += ["--allow-unsigned-replicas"]
    return options_from(build_parser().parse_args(args), role)


# ---- which names -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("header, expected", [
    ("127.0.0.1:8000", "127.0.0.1"), ("LocalHost.:80", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("evil.example", "evil.example"), ("::1", None), ("a b", None), ("x:y", None), ("[::1]x", None), ("", None),
    ("[evil.example]:80", None),
])
def test_host_name(header, expected):
    assert host_name(header) == expected


LOOPBACK_OK = ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "127.0.0.2", "app.localhost:8000",
               "127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:8000"]  # an empty port (RFC 3986); v4-mapped loopback
ALWAYS_REFUSED = ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example",
                  "testserver", "", "a b", "[::1", "x:y"]


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_server_answers_loopback_names_only(bind):
    policy = HostPolicy(bind)
    assert all(policy.allows(h) for h in LOOPBACK_OK)
    assert not any(policy.allows(h) for h in [*ALWAYS_REFUSED, "10.1.2.3:8000", "[fe80::1]", MACHINE])
    assert policy.allows(None)  # no Host at all (HTTP/1.0): never a browser's request


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_server_on_the_network_also_answers_addresses_and_its_machine_name(bind):
    policy = HostPolicy(bind, also=("pod-7.internal",))
    assert all(policy.allows(h) for h in [*LOOPBACK_OK, "10.1.2.3:8000", "[fe80::1]:80", "192.168.1.9",
                                          MACHINE, f"{MACHINE}:8000", "pod-7.internal:8000"])
    assert not any(policy.allows(h) for h in ALWAYS_REFUSED)


def test_allowed_hosts_adds_names_domains_addresses_or_any():
    policy = HostPolicy("127.0.0.1", ("api.example.com", ".corp.example", "10.0.0.5", "[fd00::1]"))
    for ok in ("api.example.com", "API.example.com.:443", "corp.example", "x.y.corp.example", "10.0.0.5:80",
               "[fd00::1]:8000", "localhost"):
        assert policy.allows(ok), ok
    for bad in ("example.com", "evil-corp.example", "corp.example.evil", "10.0.0.6", "evil.example"):
        assert not policy.allows(bad), bad
    assert all(HostPolicy("127.0.0.1", ("*",)).allows(h) for h in ["evil.example", "testserver", "a b"])


@pytest.mark.parametrize("entry", ["http://api.example.com", "api.example.com:8000", "a b", "", "*.example.com",
                                   "exa mple", "[10.0.0.1"])
def test_a_wrong_allowed_host_is_refused_naming_the_flag(entry):
    with pytest.raises(InvalidInputError, match="--allowed-hosts"):
        HostPolicy("127.0.0.1", (entry,))


def test_serve_and_router_refuse_a_wrong_allowed_host_before_any_work():
    """Before the port is bound or anything loads (no model "m" exists)."""
    for role, run in ((SERVE, serve), (ROUTER, run_router)):
        with pytest.raises(InvalidInputError, match="--allowed-hosts"):
            asyncio.run(run(options(role, "--allowed-hosts", "https://evil.example")))


# ---- the apps --------------------------------------------------------------------------------------------
class _Engine(NS):
    def __init__(self):
        super().__init__(model_name="m", is_healthy=True, unhealthy_reason=None, not_ready_reason=None,
                         metrics=NS(render=lambda: b"vlserve:num_requests_running 0\n"),
                         cfg=NS(limit_mm_per_prompt={"image": 8}, model_path="m", max_model_len=64))


class _Registry:
    async def list_instances(self, role=None):
        return []

    async def stop(self, deregister=True):
        pass


def server_app(*flags: str):
    return build_app(_Engine(), options(SERVE, *flags).server)


@pytest.fixture
def router_app():
    """(build with flags) -> the router's app around no replicas and a stand-in prompt hasher."""
    made = []

    def build(*flags: str):
        replicas = ReplicaSet(_Registry(), ("serve",), 60.0)
        hasher = NS(executor=ThreadPoolExecutor(1), cfg=NS(max_model_len=64, limit_mm_per_prompt={"image": 1}))
        made.append((replicas, hasher))
        return build_router_app(options(ROUTER, *flags), hasher, replicas)
    yield build
    for replicas, hasher in made:
        asyncio.run(replicas.stop())
        hasher.executor.shutdown()


def both_apps(router_app, *flags: str):
    return {"server": server_app(*flags), "router": router_app(*flags)}


def test_the_host_check_answers_400_before_any_route(router_app):
    for name, app in both_apps(router_app).items():
        opts = options(SERVE if name == "server" else ROUTER)
        client = TestClient(HostCheck(app, HostPolicy.of(opts.server)), base_url="http://127.0.0.1:8000")
        assert client.get("/health").status_code == 200, name
        for path in ("/health", "/", "/playground/app.js", "/v1/models"):
            resp = client.get(path, headers={"host": "evil.example:8000"})
            assert resp.status_code == 400, (name, path)
            assert "invalid Host header" in resp.json()["error"]["message"]
        assert client.get("/", headers={"host": "localhost:8000"}).status_code == 200


def test_trailing_slash_redirects_never_name_the_requests_host(router_app):
    for name, app in both_apps(router_app).items():
        client = TestClient(app, base_url="http://evil.example", follow_redirects=False)
        for path, location in (("/playground/", "/playground"), ("/v1/models/?x=1&y=%2F", "/v1/models?x=1&y=%2F"),
                               ("/health/", "/health")):
            resp = client.get(path)
            assert resp.status_code == 307 and resp.headers["location"] == location, (name, path, resp.headers)
        post = client.post("/v1/chat/completions/", content=b"{}")
        assert post.status_code == 307 and post.headers["location"] == "/v1/chat/completions"
        # a path that would redirect to another host ("//evil.example": protocol-relative) is not redirected
        for path in ("//evil.example/", "/\\evil.example/", "/nothing/"):
            resp = client.get("http://evil.example" + path)
            assert resp.status_code == 404 and "location" not in resp.headers, (name, path)


def test_metrics_stay_open_under_the_api_key(router_app):
    """Decided as vLLM does: Prometheus scrapers (and the router's own scrape of its replicas) read /metrics
    without a key; /v1 needs it."""
    for name, app in both_apps(router_app, "--api-key", KEY).items():
        client = TestClient(app, base_url="http://127.0.0.1")
        assert client.get("/metrics").status_code == 200, name
        assert client.get("/v1/models").status_code == 401, name
        assert client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200, name


# ---- the real processes ----------------------------------------------------------------------------------
def test_served_processes_check_the_host_and_redirect_relatively(tiny_ckpt):
    from tests.server_utils import RemoteServer, RoleProcess, free_port

    ckpt = tiny_ckpt("qwen2_vl")
    port = free_port()
    router = RoleProcess("router", ["router", "--model", str(ckpt), "--port", str(port), "--bootstrap",
                                    f"127.0.0.1:{free_port()}", "--allow-unsigned-replicas", "--api-key", KEY,
                                    "--allowed-hosts", "api.example.com"], f"http://127.0.0.1:{port}/health")
    server = RemoteServer(ckpt, api_key=KEY, wait=False)
    try:
        router.wait_healthy()
        server.wait_healthy()
        for url in (server.url, f"http://127.0.0.1:{port}"):
            assert HTTP.get(f"{url}/health", headers={"host": "evil.example"}).status_code == 400, url
            assert HTTP.get(f"{url}/", headers={"host": "localhost:1234"}).status_code == 200, url
            redirect = HTTP.get(f"{url}/playground/", headers={"host": "localhost"})
            assert redirect.status_code == 307 and redirect.headers["location"] == "/playground", url
            assert HTTP.get(f"{url}/metrics").status_code == 200, url
            assert HTTP.get(f"{url}/v1/models").status_code == 401, url
        # the router was told one more name
        assert HTTP.get(f"http://127.0.0.1:{port}/health", headers={"host": "api.example.com"}).status_code == 200
        assert HTTP.get(f"{server.url}/health", headers={"host": "api.example.com"}).status_code == 400
    finally:
        server.close()
        router.close()
