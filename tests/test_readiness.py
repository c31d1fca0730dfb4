"""Liveness and readiness: /health says the engine is alive; /ready says this instance can serve what it accepts
(its engine and, where it needs them, a paired peer). A request that arrives while no peer is paired waits up to
--peer-wait-timeout for one instead of failing at once."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tests.server_utils import HTTP, RoleProcess, free_port
from tests.test_disagg import HB, SECRET, picture_chat
from vlserve.disagg.peer_client import PeerClient


def test_a_language_server_is_ready_once_an_encoder_pairs_and_a_request_waits_for_it(tiny_ckpt):
    env = {"VLSERVE_DISAGG_SECRET": SECRET}
    boot_port, lang_port, enc_port = free_port(), free_port(), free_port()
    common = ["--model", str(tiny_ckpt("qwen2_vl")), "--dtype", "float32", "--bootstrap", f"127.0.0.1:{boot_port}",
              "--heartbeat-interval", HB]
    procs = []
    try:
        procs.append(RoleProcess("bootstrap", ["bootstrap", "--port", str(boot_port), "--heartbeat-interval", HB],
                                 f"http://127.0.0.1:{boot_port}/health", env=env).wait_healthy())
        lang_url = f"http://127.0.0.1:{lang_port}"
        procs.append(RoleProcess("language", ["language", *common, "--port", str(lang_port), "--max-model-len", "1024",
                                              "--peer-wait-timeout", "60"], lang_url + "/health",
                                 env=env).wait_healthy())
        assert HTTP.get(lang_url + "/health").status_code == 200  # alive ...
        not_ready = HTTP.get(lang_url + "/ready")
        assert not_ready.status_code == 503  # ... but nothing to encode its pictures yet
        assert "no encoder is paired" in not_ready.json()["error"]["message"]

        result = {}
        body = {"messages": picture_chat(1), "max_tokens": 3}
        asking = threading.Thread(target=lambda: result.setdefault(
            "r", HTTP.post(lang_url + "/v1/chat/completions", json=body, timeout=120)))
        asking.start()
        time.sleep(0.5)  # the request is in before any encoder exists
        procs.append(RoleProcess("encoder", ["encode", *common, "--port", str(enc_port), "--data-port",
                                             str(free_port())], f"http://127.0.0.1:{enc_port}/health", env=env))
        asking.join(120)
        assert result["r"].status_code == 200, result["r"].text  # it waited for the encoder, no 503
        assert HTTP.get(lang_url + "/ready").status_code == 200
        assert HTTP.get(f"http://127.0.0.1:{enc_port}/ready").status_code == 200
    finally:
        for p in reversed(procs):
            p.close()


def _waiter(timeout: float, pick) -> SimpleNamespace:
    return SimpleNamespace(opts=SimpleNamespace(peer_wait_timeout=timeout), _pick=pick, _peer_paired=asyncio.Event())


def test_with_no_peer_a_request_waits_the_peer_wait_timeout_then_gets_none():
    async def go():
        client = _waiter(0.3, lambda key, exclude, needs: None)
        t0 = time.monotonic()
        assert await PeerClient._first_peer(client, "k") is None
        return time.monotonic() - t0

    assert asyncio.run(go()) >= 0.25  # it did wait


def test_a_peer_that_pairs_during_the_wait_takes_the_request():
    peers: list = []

    async def go():
        client = _waiter(30, lambda key, exclude, needs: peers[0] if peers else None)

        async def pair_later():
            await asyncio.sleep(0.2)
            peers.append("encoder")
            client._peer_paired.set()

        pairing = asyncio.create_task(pair_later())
        got = await PeerClient._first_peer(client, "k")
        await pairing
        return got

    assert asyncio.run(go()) == "encoder"


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_no_wait_when_the_timeout_is_zero(timeout):
    assert asyncio.run(PeerClient._first_peer(_waiter(timeout, lambda key, exclude, needs: None), "k")) is None
