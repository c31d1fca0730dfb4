"""Replicas announce themselves for `vlserve router`: the KV events endpoint they advertise, the serve replica's
registry record, and that the bootstrap registry accepts the "serve" role."""

from __future__ import annotations

import asyncio

import pytest

from vlserve.core.config import Options
from vlserve.disagg.registry import ROLES, InstanceInfo, advertised_events_endpoint
from vlserve.server.announce import REPLICA_ROLE, announce_replica, replica_info


@pytest.mark.parametrize("endpoint, expected", [
    (None, ""), ("", ""),
    ("tcp://0.0.0.0:5557", "tcp://10.0.0.7:5557"), ("tcp://*:5557", "tcp://10.0.0.7:5557"),
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"), ("tcp://127.0.0.1:*", ""),
])
def test_advertised_events_endpoint(endpoint, expected):
    assert advertised_events_endpoint(endpoint, "10.0.0.7") == expected


def test_serve_replica_info():
    assert REPLICA_ROLE in ROLES
    opts = Options()
    opts.server.host, opts.server.port = "0.0.0.0", 8123
    opts.disagg.advertise_host = "10.1.2.3"
    opts.engine.kv_events_endpoint = "tcp://0.0.0.0:7001"
    info = replica_info(opts)
    assert (info.role, info.http_address, info.kv_events) == ("serve", "10.1.2.3:8123", "tcp://10.1.2.3:7001")


def test_serve_without_registry_does_not_announce():
    assert asyncio.run(announce_replica(Options(), engine=None)) is None


def test_bootstrap_lists_serve_replicas():
    from fastapi.testclient import TestClient

    from vlserve.disagg.bootstrap import build_bootstrap_app

    app = build_bootstrap_app(heartbeat_interval=1.0, failure_threshold=3)
    info = InstanceInfo("a" * 32, "serve", "127.0.0.1:8000", "127.0.0.1:8000", kv_events="tcp://127.0.0.1:7001")
    import msgspec

    with TestClient(app) as client:
        assert client.post("/register", content=msgspec.json.encode(info)).status_code == 200
        listed = client.get("/instances", params={"role": "serve"}).json()["instances"]
    assert [i["kv_events"] for i in listed] == ["tcp://127.0.0.1:7001"]
