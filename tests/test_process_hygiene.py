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

from tests.server_utils import descendants, free_port, start_vlserve
from vlserve.core.errors import EXIT_CONFIG

START_FAILURE_TRIES = 2  # the note reports 10; two keep the suite fast and still catch a hang that comes and goes


def _vlserve(*args: str, **kw) -> subprocess.Popen:
    return start_vlserve(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


@pytest.fixture(scope="module")
def broken(tiny_ckpt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("broken")
    shutil.copytree(tiny_ckpt("qwen2_vl"), folder, dirs_exist_ok=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # fails only in the engine process
    return folder


def test_engine_start_failure_exits_nonzero_quickly_every_time(broken):
    for _ in range(START_FAILURE_TRIES):
        proc = _vlserve("serve", "--model", str(broken), "--port", str(free_port()))
        # It must give up, not retry: a server that keeps restarting its engine never exits and this times out
        # (generous: start-up takes ~10 s quiet and three times that on a busy 2-core machine; no timing asserts).
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == EXIT_CONFIG, out  # a corrupt checkpoint: restarting it would not help
        assert "the engine failed to start" in out and "corrupt" in out
        assert "Traceback" not in out.split("ERROR vlserve:")[-1]


def test_taken_port_is_reported_before_the_model_loads(tiny_ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _vlserve("serve", "--model", str(tiny_ckpt("qwen2_vl")), "--port", str(port))
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out
    assert "engine" not in out.lower().replace("vlserve.engine", "")  # nothing was started: reported at once


def _engine_child(pid: int, timeout: float = 60) -> int:
    """The engine-core process of the server `pid` as soon as it exists (it is then still importing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in descendants(pid):
            try:
                if "spawn_main" in open(f"/proc/{child}/cmdline").read():
                    return child
            except FileNotFoundError:
                pass
        time.sleep(0.02)
    raise AssertionError("no engine process appeared")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _transfer_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"vlserve-transfer-{pid}-")]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_sigterm_during_start_up_stops_the_engine_and_leaves_no_file(tiny_ckpt):
    """SIGTERM while the engine process still loads: the server stops it and removes its receive-buffer file
    (a language server's) instead of dying on the spot and leaving both behind."""
    proc = _vlserve("language", "--model", str(tiny_ckpt("qwen2_vl")), "--port", str(free_port()), "--bootstrap",
                    f"127.0.0.1:{free_port()}", "--dtype", "float32", "--max-model-len", "512")
    try:
        engine = _engine_child(proc.pid)
        assert _transfer_files(proc.pid), "the receive buffers are made before the engine starts"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM during start-up: stopped" in out and "Traceback" not in out, out[-3000:]
    assert _gone(engine, 10), "the engine process outlived its server"
    assert not _transfer_files(proc.pid)


def test_an_engine_whose_server_was_killed_while_it_started_exits(tiny_ckpt):
    """SIGKILL (nothing can be cleaned up) while the engine process still imports: it notices it has no server
    once it can and exits, instead of loading the model for nobody and living on under init."""
    proc = _vlserve("serve", "--model", str(tiny_ckpt("qwen2_vl")), "--port", str(free_port()), "--dtype",
                    "float32", "--max-model-len", "512")
    try:
        engine = _engine_child(proc.pid)
        proc.kill()
        proc.wait()
        assert _gone(engine, 60), "the engine process lives on without its server"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_disagg_with_a_bad_model_stops_at_once_and_says_which_role(tmp_path):
    proc = _vlserve("serve", "--disagg", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_CONFIG, out  # at once: no role is restarted (it took ~58 s when each was, 5 times)
    assert "restarting" not in out and "cannot start with this configuration" in out, out
    assert "[encoder-0] vlserve: model" in out and "no such folder" in out, out  # the role names its lines


def test_servers_a_test_starts_die_with_the_test_process(tiny_ckpt, tmp_path):
    """A test run killed outright (no teardown) leaves no server or engine process behind."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys, time\n"
        "from tests.server_utils import RemoteServer\n"
        "srv = RemoteServer(sys.argv[1], '--dtype', 'float32', '--max-model-len', '512')\n"
        "print(srv.proc.pid, srv.engine_pid(), flush=True)\n"
        "time.sleep(600)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    holder = subprocess.Popen([sys.executable, str(script), str(tiny_ckpt("qwen2_vl"))], stdout=subprocess.PIPE,
                              text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        server, engine = map(int, holder.stdout.readline().split())
    finally:
        holder.kill()
        holder.wait()
    assert _gone(server, 30) and _gone(engine, 30), "a server outlived the test process that started it"
