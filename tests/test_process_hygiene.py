"""Process hygiene of `vlserve serve` and `serve --disagg`: start-up failures exit non-zero within seconds every
time, a taken port is reported before any model loads, and SIGTERM / SIGINT stop every role quietly: a server
drains what is in flight (--shutdown-timeout), then ends it with error events, without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_utils import HTTP, RemoteServer, descendants, free_port, is_engine_process, start_vlserve
from vlserve.core.errors import EXIT_CONFIG

START_FAILURE_TRIES = 2  # the note reports 10; two keep the suite fast and still catch a hang that comes and goes


def _vlserve(*args: str, **kw) -> subprocess.Popen:
    # (a disaggregated role starts only with the deployment's secret)
    return start_vlserve(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "VLSERVE_DISAGG_SECRET": "test-secret"}, **kw)


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
            if is_engine_process(child):
                return child
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


# ---- a graceful stop: drain, then cut -----------------------------------------------------------------------
LONG = 30000  # tokens: minutes here; only the stop ends such a stream
SHORT = 600  # tokens: a few seconds here, so it is still running when the stop comes
LONG_CONTEXT = ("--dtype", "float32", "--max-model-len", "32768")
NO_TRACEBACK = ("Traceback", "Exception in ASGI application")


def _open_stream(url: str, path: str, body: dict) -> dict:
    """An SSE stream read on a thread: its non-empty lines; `first` is set once one came, `done` at its end."""
    state = {"lines": [], "first": threading.Event(), "done": threading.Event(), "error": None}

    def read() -> None:
        try:
            with HTTP.stream("POST", url + path, json={**body, "stream": True, "ignore_eos": True},
                             timeout=120) as resp:
                for line in resp.iter_lines():
                    if line:
                        state["lines"].append(line)
                        state["first"].set()
        except httpx.HTTPError as e:
            state["error"] = e
        finally:
            state["first"].set()
            state["done"].set()

    threading.Thread(target=read, daemon=True).start()
    return state


def _until_draining(server: RemoteServer) -> None:
    """Once /ready says 503, the server has taken the signal: it drains."""
    deadline = time.monotonic() + 60
    while HTTP.get(server.url + "/ready", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.05)


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]


def _ends_with_error_and_done(stream: dict) -> dict:
    assert stream["done"].wait(120) and stream["error"] is None, stream["error"]
    lines = stream["lines"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"], error
    return error


def test_ctrl_c_drains_then_ends_every_api_stream_with_its_error_event(tiny_ckpt):
    """Ctrl-C with streams in flight: new requests get 503 and /ready 503 while /health answers; after
    --shutdown-timeout the streams end with their API's error event (chat, completions: then [DONE]; Responses:
    `error` then `response.failed`); no traceback in the log, exit code 0."""
    with RemoteServer(tiny_ckpt("qwen2_vl"), *LONG_CONTEXT, "--shutdown-timeout", "5") as server:
        streams = [_open_stream(server.url, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}),
                   _open_stream(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": LONG}),
                   _open_stream(server.url, "/v1/responses", {"input": "hi", "max_output_tokens": LONG})]
        for stream in streams:
            assert stream["first"].wait(120) and stream["lines"], stream["error"]
        os.killpg(server.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        _until_draining(server)
        late = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == 503, late.text
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
        chat, completion, responses = streams
        assert "--shutdown-timeout" in _ends_with_error_and_done(chat)["message"]
        _ends_with_error_and_done(completion)
        assert responses["done"].wait(120) and responses["error"] is None, responses["error"]
        error, failed = _events(responses["lines"])[-2:]
        assert error["type"] == "error" and error["code"] == "503", error
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed", failed
        assert server.proc.wait(60) == 0
        log = server.read_log()
    assert not any(bad in log for bad in NO_TRACEBACK), log[-6000:]


def test_a_stream_within_the_timeout_finishes_and_a_second_sigterm_ends_the_rest(tiny_ckpt):
    """SIGTERM (what Kubernetes sends the process): a stream that ends within --shutdown-timeout ends as usual;
    a second SIGTERM ends the drain at once (not after the 600 s), the other stream with its error event."""
    with RemoteServer(tiny_ckpt("qwen2_vl"), *LONG_CONTEXT, "--shutdown-timeout", "600") as server:
        chat = {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}
        short = _open_stream(server.url, "/v1/chat/completions", {**chat, "max_tokens": SHORT})
        long = _open_stream(server.url, "/v1/chat/completions", {**chat, "max_tokens": LONG})
        for stream in (short, long):
            assert stream["first"].wait(120) and stream["lines"], stream["error"]
        server.proc.send_signal(signal.SIGTERM)
        _until_draining(server)
        assert short["done"].wait(300) and short["error"] is None, short["error"]
        assert short["lines"][-1] == "data: [DONE]"
        events = _events(short["lines"])
        assert not any("error" in e for e in events), events[-3:]
        assert events[-1]["usage"]["completion_tokens"] == SHORT
        server.proc.send_signal(signal.SIGTERM)
        _ends_with_error_and_done(long)
        assert server.proc.wait(60) == 0
        log = server.read_log()
    assert "waiting up to 600s (--shutdown-timeout) for 2 request(s) in flight" in log, log[-3000:]  # both were
    assert not any(bad in log for bad in NO_TRACEBACK), log[-6000:]
