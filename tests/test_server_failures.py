"""Server defaults and failures: loopback media refused by default (SSRF); a dead engine process turns into 503s
for the requests in flight instead of hanging, then the server exits non-zero so that its supervisor restarts it
(vLLM's behaviour; before, it answered 503 for ever beside a defunct engine); a frozen one is taken back."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import noise_image
from tests.server_utils import HTTP, RemoteServer
from tests.test_server_api import data_url, image_part, user


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with RemoteServer(tiny_ckpt("qwen2_5_vl"), "--dtype", "float32", "--max-model-len", "1024") as srv:
        yield srv


def test_private_and_loopback_media_urls_are_refused_by_default(server):
    for url in ("http://127.0.0.1:9/x.png", "http://localhost:9/x.png", "http://169.254.169.254/latest/meta-data",
                "http://[::1]:9/x.png", "http://10.1.2.3/x.png"):
        r = server.post("/v1/chat/completions", json={"messages": user(image_part(url)), "max_tokens": 2})
        assert r.status_code == 400, (url, r.text)
        assert "private" in r.json()["error"]["message"] or "loopback" in r.json()["error"]["message"]
    ok = server.post("/v1/chat/completions",
                     json={"messages": user(image_part(data_url(noise_image(40, 40, 1))), "hi"), "max_tokens": 2})
    assert ok.status_code == 200


def test_image_embeddings_are_refused_unless_enabled(server):
    part = {"type": "image_embeds", "image_embeds": "AAAA", "image_grid_thw": [1, 4, 4]}
    r = server.post("/v1/chat/completions", json={"messages": user(part), "max_tokens": 2})
    assert r.status_code == 400 and "enable-mm-embeds" in r.json()["error"]["message"]


def test_dead_engine_gives_503_not_a_hang(server):
    in_flight: dict = {"lines": []}
    streaming = threading.Event()

    def long_stream():
        body = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    in_flight["lines"].append(line)
                    streaming.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert streaming.wait(20)
    os.kill(server.engine_pid(), signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the in-flight stream hung after the engine died"
    assert in_flight["lines"][-1] == "data: [DONE]"
    assert any('"code":503' in line for line in in_flight["lines"]), in_flight["lines"][-3:]

    assert server.proc.wait(30) == 1, "the server kept running beside a dead engine"
    log = server.read_log()
    assert "stopping this server with exit code 1" in log and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):  # nothing answers 503 for ever on that port
        HTTP.get(server.url + "/health", timeout=5)


def test_frozen_engine_is_noticed_and_taken_back(tiny_ckpt):
    """SIGSTOP: the process lives but answers nothing. /health and waiting requests get 503 within the heartbeat
    timeout; once it runs again (SIGCONT) the server serves again."""
    with RemoteServer(tiny_ckpt("qwen2_vl"), "--dtype", "float32", "--max-model-len", "512",
                      "--engine-heartbeat-timeout", "2") as srv:
        result: dict = {}

        def waiting_request():
            result["r"] = srv.post("/v1/completions", json={"prompt": "go", "max_tokens": 400, "ignore_eos": True})

        engine = srv.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            t = threading.Thread(target=waiting_request)
            t0 = time.monotonic()
            t.start()
            deadline = time.monotonic() + 15
            while HTTP.get(srv.url + "/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "a frozen engine was not noticed"
                time.sleep(0.2)
            t.join(15)
            assert not t.is_alive() and result["r"].status_code == 503, result
            assert time.monotonic() - t0 < 15
            assert "answered" in srv.read_log()
        finally:
            os.kill(engine, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while HTTP.get(srv.url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the engine was not taken back after SIGCONT"
            time.sleep(0.2)
        r = srv.post("/v1/completions", json={"prompt": "again", "max_tokens": 3})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10  # the request failed while frozen is aborted: its blocks come back
        while srv.metrics()["vlserve:kv_cache_usage_perc"] > 0 or srv.metrics()["vlserve:num_requests_running"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
