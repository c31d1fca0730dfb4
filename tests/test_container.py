"""The container image is built and answers a picture chat as its own user (uid 10001) on every address, through
`podman` or `buildah` + `podman` (daemonless). It needs a builder, a reachable image registry for the base image
and about 10 minutes, so it runs only when asked: VLSERVE_CONTAINER_TEST=1; otherwise it says which of those is
missing."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import noise_image
from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = "https://registry-1.docker.io/v2/"


def _missing() -> str | None:
    if os.environ.get("VLSERVE_CONTAINER_TEST") != "1":
        return "builds an image (~10 minutes): set VLSERVE_CONTAINER_TEST=1 to run it"
    if shutil.which("podman") is None:
        return "no podman here (apt-get install podman)"
    try:
        httpx.get(REGISTRY, timeout=5.0)
    except httpx.HTTPError as e:
        return f"the base image's registry cannot be reached ({type(e).__name__})"
    return None


MISSING = _missing()


@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_the_cpu_image_answers_a_picture_chat_as_its_own_user():
    tag = "vlserve-test:cpu"
    subprocess.run(["podman", "build", "-t", tag, str(ROOT)], check=True, timeout=3600)
    port = free_port()
    name = f"vlserve-test-{port}"
    subprocess.run(["podman", "run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:8000", tag], check=True,
                   timeout=120)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the container's server never became healthy")
        uid = subprocess.run(["podman", "exec", name, "id", "-u"], capture_output=True, text=True, check=True)
        assert uid.stdout.strip() == "10001"
        png = io.BytesIO()
        noise_image(64, 48, 1).save(png, format="PNG")
        picture = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "vlserve-demo", "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "What is it?"}]}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
