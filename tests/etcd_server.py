"""A real etcd server for tests (Debian's etcd-server, installed by `make install` where it can): one member on
loopback, its data in a folder the test owns, so it can be killed and started again on the same data dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from vlserve.core.processes import free_port

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
needs_etcd = pytest.mark.skipif(ETCD is None, reason="no etcd binary: `make install` installs Debian's etcd-server "
                                "where it runs as root with apt; elsewhere apt-get install etcd-server")


class EtcdServer:
    def __init__(self, data_dir: Path, extra_args: tuple[str, ...] = (), scheme: str = "http") -> None:
        self.data_dir, self.extra_args, self.scheme = Path(data_dir), tuple(extra_args), scheme
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """As --registry takes it."""
        return f"{'etcds' if self.scheme == 'https' else 'etcd'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0, wait: bool = True) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [ETCD, "--name", "t", "--data-dir", str(self.data_dir),
               "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"t={peer}", "--log-level", "warn", *self.extra_args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0, verify=True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                # /health needs no auth; "true" once the member has a leader.
                if httpx.get(f"{self.endpoint}/health", timeout=1.0,
                             verify=verify).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd did not come up on {self.endpoint}: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone (a crash, a pulled plug)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.kill()
