"""Process hygiene of `vlserve serve` and `serve --disagg`: start-up failures exit non-zero within seconds every
time, a taken port is reported before any model loads, and SIGTERM / SIGINT stop every role quietly."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.server_utils import free_port, wait_healthy

START_FAILURE_TRIES = 3  # the note reports 10; three keep the suite fast and still catch a flaky hang


def _vlserve(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlserve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


@pytest.fixture(scope="module")
def broken(tiny_ckpt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("broken")
    shutil.copytree(tiny_ckpt("qwen2_vl"), folder, dirs_exist_ok=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # fails only in the engine process
    return folder


def test_engine_start_failure_exits_nonzero_quickly_every_time(broken):
    for _ in range(START_FAILURE_TRIES):
        t0 = time.monotonic()
        proc = _vlserve("serve", "--model", str(broken), "--port", str(free_port()))
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        assert proc.returncode == 1, out
        assert took < 30, f"took {took:.1f}s to give up"
        assert "the engine failed to start" in out and "corrupt" in out
        assert "Traceback" not in out.split("ERROR vlserve:")[-1]


def test_taken_port_is_reported_before_the_model_loads(tiny_ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        proc = _vlserve("serve", "--model", str(tiny_ckpt("qwen2_vl")), "--port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out
    assert "engine" not in out.lower().replace("vlserve.engine", "")  # nothing was started
    assert time.monotonic() - t0 < 20


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = {int(p) for p in out.split()}
    return kids | {g for k in kids for g in _children(k)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_disagg_stops_every_role_quietly(tiny_ckpt, sig):
    port = free_port()
    proc = _vlserve("serve", "--model", str(tiny_ckpt("qwen2_vl")), "--disagg", "--port", str(port), "--dtype",
                    "float32", "--max-model-len", "512", "--heartbeat-interval", "0.3")
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", 120, "serve --disagg", lambda: "")
        family = _children(proc.pid)
        assert len(family) >= 4  # bootstrap, encoder, language and its engine process
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    alive = [p for p in family if os.path.exists(f"/proc/{p}") and "zombie" not in
             open(f"/proc/{p}/status").read().lower()]
    assert not alive, f"roles still running after {sig.name}: {alive}"
    assert " WARNING " not in out and " ERROR " not in out and "Traceback" not in out, out[-3000:]
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))
