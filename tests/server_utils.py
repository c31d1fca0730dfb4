"""Start `vlserve serve` as a real subprocess on a free port, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vlserve.core.processes import ENGINE_PROCESS_NAME, die_with_parent, free_port

LOG_DIR_ENV = "VLSERVE_TEST_LOG_DIR"

# One HTTP client per test process for every request the tests make with it (health polls, metrics scrapes,
# posts): a client costs ~30 ms of CPU to make (its TLS context, even for http://), which `httpx.get` pays on
# every call (a wait polling every 0.1 s spent a third of a core on it). No kept-alive connections: each request
# opens its own, as `httpx.get` does. Thread-safe.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def log_file(prefix: str):
    """A log file for a process a test starts, kept after the test (a failure's message quotes it). In the
    session's log folder (tests/conftest.py: under pytest's own temporary folder, of which only the last few runs
    are kept), so a run leaves nothing behind in /tmp."""
    folder = os.environ.get(LOG_DIR_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return tempfile.NamedTemporaryFile("w+", prefix=prefix, suffix=".log", delete=False, dir=folder or None)


def start_vlserve(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """`python -m vlserve ARGS` in a process group of its own that dies with this test process, even when the test
    run is killed outright (no fixture teardown then): nothing a test starts outlives it.

    With $VLSERVE_TEST_PROCESS_LOG set, each start appends a line (the test, the command) to that file: where the
    suite's time goes is mostly process starts (~4 CPU-seconds a server: torch and transformers, torch again in
    its engine process)."""
    if os.environ.get("VLSERVE_TEST_PROCESS_LOG"):
        with open(os.environ["VLSERVE_TEST_PROCESS_LOG"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{' '.join(args)[:160]}\n")
    return subprocess.Popen([sys.executable, "-m", "vlserve", *args], start_new_session=True,
                            preexec_fn=die_with_parent, **popen_kwargs)


def is_engine_process(pid: int) -> bool:
    """An engine-core process (forked or spawned, it names itself; not the resource tracker)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == ENGINE_PROCESS_NAME
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...), as `ps` sees them now."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = {int(p) for p in out.split()}
    return kids | {g for k in kids for g in descendants(k)}


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C first (the process shuts its children down in order), then kill; then whatever is left of its
    process group (start_vlserve) goes too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        if os.getpgid(proc.pid) == proc.pid:  # pid not reused yet: the group is still the one we started
            os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str, read_log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{read_log()}")
        try:
            if HTTP.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} not healthy after {timeout}s:\n{read_log()}")


class RemoteServer:
    def __init__(self, model: Path | str | None, *args: str, api_key: str | None = None, timeout: float = 180,
                 wait: bool = True):
        """`wait=False`: returns once started; `wait_healthy()` then (several servers starting side by side, all
        from this thread: a server dies with the thread that started it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # model None: no --model, the demo checkpoint served as `vlserve-demo` (as `make serve` runs it)
        cmd = ["serve", *(["--model", str(model)] if model is not None else []), "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = log_file("vlserve-server-")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = start_vlserve(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 180) -> None:
        try:
            wait_healthy(self.proc, self.url + "/health", timeout, "server", self.read_log)
        except RuntimeError:
            self.close()
            raise

    def read_log(self) -> str:
        return Path(self.log.name).read_text()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        return HTTP.post(self.url + path, headers={**self.headers(), **(headers or {})}, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {name: value} (label sets dropped; one model per server)."""
        out = {}
        for line in HTTP.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def engine_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if is_engine_process(int(pid)):
                return int(pid)
        raise RuntimeError("no engine process")

    def close(self) -> None:
        stop(self.proc)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RoleProcess:
    """Any `python -m vlserve <role> ...` process with an HTTP /health, for the disaggregation tests."""

    def __init__(self, name: str, args: list[str], health_url: str, timeout: float = 180, env: dict | None = None):
        self.name, self.health_url = name, health_url
        self.log = log_file(f"vlserve-{name}-")
        self.proc = start_vlserve(args, stdout=self.log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.timeout = timeout

    def wait_healthy(self) -> "RoleProcess":
        wait_healthy(self.proc, self.health_url, self.timeout, self.name, self.read_log)
        return self

    def read_log(self) -> str:
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}."""
    out = {}
    for line in HTTP.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def socket_inodes(pids) -> set[str]:
    """The inodes of the sockets these processes hold open (as /proc/net/unix and /proc/net/tcp name them);
    a process gone meanwhile holds none."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes
