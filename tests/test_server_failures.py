"""Server defaults and failures: loopback media refused by default (SSRF), and a dead engine process turns into
503s on /health and on requests, in flight or new, instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_utils import RemoteServer
from tests.test_server_api import data_url, image_part, user
from tests.conftest import noise_image


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
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
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

    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "engine" in httpx.get(server.url + "/health").json()["error"]["message"]
    r = server.post("/v1/chat/completions", json={"messages": user("hi"), "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_model_that_fails_to_load_exits_cleanly_before_listening(tiny_ckpt, tmp_path):
    import shutil
    import subprocess
    import sys

    from tests.server_utils import free_port

    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt("qwen2_vl"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # the engine process fails to load
    proc = subprocess.run([sys.executable, "-m", "vlserve", "serve", "--model", str(broken), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "engine core failed to start" in proc.stderr and "Traceback" not in proc.stderr.split("ERROR vlserve:")[-1]
