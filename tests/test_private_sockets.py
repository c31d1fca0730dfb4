"""Sockets between our own processes on one machine (issue #78): another user cannot reach them, and a second
process of the same user that connects is refused, never served, while requests keep working; the private
folders they live in go at exit, and a crashed owner's are swept at the next start."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from tests.server_utils import HTTP, RemoteServer, socket_inodes
from vlserve.core.private_dirs import PrivateDir, runtime_dir, sweep_dead_dirs

NOBODY = 65534
ENGINE_PREFIX = "vlserve-ipc-"

def _impose(addresses: list[str], other_user: bool, conn) -> None:
    """The imposter, in a forked process (the venv's python may lie where another user cannot run it): for each
    address, a raw connect, then every socket kind that could take or feed something (a PULL taking input
    messages, also one with a guessed token, a PUSH forging an engine failure, a DEALER forging a
    tensor-parallel rank's failure), until told to stop; sends back what got through."""
    import select
    import socket

    import zmq

    from vlserve.core.wire import EngineFailed, EngineMessage, Framer
    from vlserve.engine.tp.messages import Failed, FollowerMessage

    if other_user:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    ctx = zmq.Context()
    report, owner = {}, {}
    for address in addresses:
        path = address.removeprefix("ipc://")
        connected = None
        if address.startswith("ipc://"):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                raw.connect("\0" + path[1:] if path.startswith("@") else path)
                connected = True
            except OSError:
                connected = False
            finally:
                raw.close()
        pull, push, dealer = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
        guessing = ctx.socket(zmq.PULL)  # speaks the engine's mechanism, with a guessed token
        guessing.plain_username, guessing.plain_password = b"vlserve", b"0" * 64
        for sock in (pull, push, dealer, guessing):
            sock.linger = 0
            sock.connect(address)
        forged = [(push, Framer(EngineMessage).encode(EngineFailed("forged by an imposter"))),
                  (dealer, Framer(FollowerMessage).encode(Failed(1, "forged by an imposter")))]
        for sock, frames in forged:
            try:
                if sock.poll(2000, zmq.POLLOUT):
                    sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass  # the connection was refused meanwhile
        report[address] = {"connected": connected, "received": 0}
        owner.update({pull: address, dealer: address, guessing: address})
    conn.send("ready")
    poller = zmq.Poller()
    for sock in owner:
        poller.register(sock, zmq.POLLIN)
    while not select.select([conn], [], [], 0)[0]:
        for sock, _ in poller.poll(100):
            sock.recv_multipart()
            report[owner[sock]]["received"] += 1
    conn.send(json.dumps(report))
    os._exit(0)  # nothing of the forked test process runs here


class Imposter:
    """`_impose` in a process of its own, connected to `addresses` (as another user: `other_user`)."""

    def __init__(self, addresses: list[str], other_user: bool):
        if other_user and os.geteuid() != 0:
            pytest.skip("connecting as another user needs root (to drop to uid 65534)")
        self.conn, theirs = multiprocessing.get_context("fork").Pipe()
        self.proc = multiprocessing.get_context("fork").Process(target=_impose, args=(addresses, other_user, theirs))
        self.proc.start()
        assert self.conn.poll(60) and self.conn.recv() == "ready", "the imposter did not start"

    def report(self) -> dict:
        self.conn.send("stop")
        assert self.conn.poll(60), "the imposter did not answer"
        report = json.loads(self.conn.recv())
        self.proc.join(10)
        return report


def _listening_unix_sockets(pids) -> list[str]:
    """ZeroMQ addresses of the Unix sockets these processes listen on (`@name` for an abstract one)."""
    inodes = socket_inodes(pids)
    found = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; flag 0x10000: listening
        if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:
            found.append(f"ipc://{fields[7]}")
    return sorted(found)


def _ask(server) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for _ in range(4):  # round-robin would hand every other one to a connected imposter
        r = HTTP.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = RemoteServer(tiny_ckpt("qwen2_vl"), "--dtype", "float32", "--max-model-len", "512")
    try:
        sockets = _listening_unix_sockets([srv.proc.pid, srv.engine_pid()])
        yield srv, sockets
    finally:
        srv.close()
    folders = {os.path.dirname(a.removeprefix("ipc://")) for a in sockets if not a.startswith("ipc://@")}
    assert not [f for f in folders if os.path.exists(f)], "a socket folder outlived its server"


def test_another_user_cannot_reach_the_engine_sockets(server):
    srv, sockets = server
    assert len(sockets) >= 3, sockets  # the engine's input, output and heartbeat
    imposter = Imposter(sockets, other_user=True)
    try:
        _ask(srv)
    finally:
        report = imposter.report()
    assert all(r["connected"] is False for r in report.values()), report
    assert all(r["received"] == 0 for r in report.values()), report
    for address in sockets:  # each in a folder of this user's only
        folder = os.stat(os.path.dirname(address.removeprefix("ipc://")))
        assert folder.st_uid == os.getuid() and folder.st_mode & 0o777 == 0o700, address
    _ask(srv)


def test_a_second_process_of_the_same_user_is_refused_not_served(server):
    srv, sockets = server
    imposter = Imposter(sockets, other_user=False)
    try:
        _ask(srv)
    finally:
        report = imposter.report()
    assert all(r["received"] == 0 for r in report.values()), report
    _ask(srv)  # its forged engine failure was never read either
    assert HTTP.get(srv.url + "/health", timeout=10).status_code == 200
    assert "refused a connection to the private socket" in srv.read_log()


def test_a_killed_servers_socket_folder_is_swept_at_the_next_start(tiny_ckpt, monkeypatch):
    # A parent folder of its own: a server another test starts meanwhile would sweep the folder first.
    parent = tempfile.mkdtemp(prefix="vlx-", dir="/tmp")  # short: the sockets' paths must fit
    monkeypatch.setenv("XDG_RUNTIME_DIR", parent)
    srv = RemoteServer(tiny_ckpt("qwen2_vl"), "--dtype", "float32", "--max-model-len", "512")
    try:
        engine = srv.engine_pid()
        folders = {os.path.dirname(a.removeprefix("ipc://")) for a in _listening_unix_sockets([srv.proc.pid])}
        assert len(folders) == 1, folders
        os.killpg(srv.proc.pid, signal.SIGKILL)  # nothing runs its clean-up
        srv.proc.wait()
        for _ in range(100):
            if not os.path.exists(f"/proc/{engine}"):
                break
            time.sleep(0.1)
    finally:
        srv.close()
    folder = folders.pop()
    assert os.path.dirname(folder) == parent and os.path.isdir(folder)
    PrivateDir(ENGINE_PREFIX, parent).remove()  # what the next start makes first
    assert not os.path.exists(folder)
    shutil.rmtree(parent)


def test_no_other_process_can_pose_as_a_tensor_parallel_rank(tiny_ckpt):
    """Before: rank 0 listened on loopback TCP, and any local process could connect and report a rank's failure,
    which stopped the engine."""
    import zmq

    from vlserve import LLM, SamplingParams

    llm = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        address = llm.engine.core.runner.executor.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        imposters = [Imposter([address], other_user=False)]
        if os.geteuid() == 0:
            imposters.append(Imposter([address], other_user=True))
        time.sleep(1.0)  # their forged messages have arrived by now, if they can
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for _ in range(2):
            assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        reports = [imposter.report() for imposter in imposters]
    finally:
        llm.shutdown()
    assert all(r["received"] == 0 for report in reports for r in report.values()), reports
    if len(reports) == 2:
        assert reports[1][address]["connected"] is False, reports


# ---- the sweep itself -------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_this_users_folders_of_dead_unlocked_owners_are_swept(tmp_path):
    dead = _dead_pid()
    gone = tmp_path / f"vlserve-x-{dead}-aaaa"
    gone.mkdir(mode=0o700)
    (gone / "input").write_text("")
    kept = {
        "live owner": tmp_path / f"vlserve-x-{os.getpid()}-bbbb",
        "locked (an owner in another PID namespace)": tmp_path / f"vlserve-x-{dead}-cccc",
        "other prefix": tmp_path / f"vlserve-y-{dead}-dddd",
        "no pid": tmp_path / "vlserve-x-eeee",
    }
    for folder in kept.values():
        folder.mkdir(mode=0o700)
    lock = os.open(kept["locked (an owner in another PID namespace)"], os.O_RDONLY)
    import fcntl

    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.geteuid() == 0:  # another user's folder is never ours to remove
        kept["another user's"] = tmp_path / f"vlserve-x-{dead}-ffff"
        kept["another user's"].mkdir()
        os.chown(kept["another user's"], NOBODY, NOBODY)
    target = tmp_path / "elsewhere"
    target.mkdir()
    kept["a link"] = tmp_path / f"vlserve-x-{dead}-gggg"
    kept["a link"].symlink_to(target)
    try:
        mine = PrivateDir("vlserve-x-", str(tmp_path))
    finally:
        os.close(lock)
    assert not gone.exists()
    assert [name for name, folder in kept.items() if not folder.exists()] == []
    assert target.is_dir()
    path = Path(mine.path)
    assert path.name.startswith(f"vlserve-x-{os.getpid()}-") and path.stat().st_mode & 0o777 == 0o700
    assert sweep_dead_dirs(str(tmp_path), "vlserve-x-") == [str(kept["locked (an owner in another PID namespace)"])]
    mine.remove()
    assert not path.exists()


def test_a_sweeper_in_another_pid_namespace_never_takes_a_folder_being_made(tmp_path, monkeypatch):
    """A sweeper that shares the parent folder but not our PID namespace sees our pid dead: right after the folder
    is made, before its owner locks it, it must not match it (before: it was removed under the new owner)."""
    from vlserve.core import private_dirs

    swept = []
    make = tempfile.mkdtemp

    def made_then_swept(*args, **kwargs):
        path = make(*args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(private_dirs, "pid_alive", lambda pid: False)  # what the other namespace sees
            swept.extend(sweep_dead_dirs(str(tmp_path), "vlserve-x-"))
        return path

    monkeypatch.setattr(private_dirs.tempfile, "mkdtemp", made_then_swept)
    mine = PrivateDir("vlserve-x-", str(tmp_path))
    monkeypatch.setattr(private_dirs, "pid_alive", lambda pid: False)
    swept.extend(sweep_dead_dirs(str(tmp_path), "vlserve-x-"))  # once made, its lock keeps it
    assert swept == [] and os.path.isdir(mine.path)
    assert os.path.basename(mine.path).startswith(f"vlserve-x-{os.getpid()}-")
    assert os.listdir(tmp_path) == [os.path.basename(mine.path)]
    mine.remove()
    assert os.listdir(tmp_path) == []


def test_a_folder_left_half_made_is_swept_once_old(tmp_path):
    """A crash between making and naming a folder leaves a hidden one: swept once it is old, never while new."""
    half = tmp_path / f".vlserve-x-{_dead_pid()}-abcd1234"
    half.mkdir(mode=0o700)
    assert sweep_dead_dirs(str(tmp_path), "vlserve-x-") == [] and half.is_dir()
    old = time.time() - 3600
    os.utime(half, (old, old))
    assert sweep_dead_dirs(str(tmp_path), "vlserve-x-") == [str(half)]


def test_a_row_server_sweeps_the_row_folders_of_dead_owners():
    import torch

    from vlserve.disagg.auth import PeerAuth
    from vlserve.disagg.transports.zmq import RowServer
    from vlserve.engine.transfer_buffers import TransferBuffers

    stale = Path(runtime_dir()) / f"vlserve-rows-{_dead_pid()}-test"
    stale.mkdir(mode=0o700)
    (stale / "rows").write_text("")
    server = RowServer(TransferBuffers.create(2, 4, 8, torch.float32, shared=False), "127.0.0.1", PeerAuth(None))
    try:
        assert not stale.exists(), "a killed receiver's row-socket folder was left"
        folder = Path(server.address.removeprefix("ipc://")).parent
        assert folder.name.startswith(f"vlserve-rows-{os.getpid()}-") and folder.stat().st_mode & 0o777 == 0o700
    finally:
        server.close()
        shutil.rmtree(stale, ignore_errors=True)
    assert not folder.exists()


# ---- the token's checker and failed starts ----------------------------------------------------------------------
def _voluntary_switches(thread) -> int:
    for line in Path(f"/proc/self/task/{thread.native_id}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    pytest.skip("no voluntary_ctxt_switches in /proc")


def test_the_token_checker_sleeps_until_someone_connects_and_ends_with_its_context():
    """Every front end and tensor-parallel leader has one: idle, it must not wake up (before: every 100 ms)."""
    import threading

    import zmq

    from vlserve.engine.private_sockets import PrivateSockets

    ctx = zmq.Context()
    private = PrivateSockets(ctx, "vlserve-ipc-")
    (checker,) = [t for t in threading.enumerate() if t.name == "vlserve-zap" and t.is_alive()]
    time.sleep(0.3)  # settled in its wait
    before = _voluntary_switches(checker)
    time.sleep(1.5)
    woke = _voluntary_switches(checker) - before
    folder = private.folder
    private.close()
    ctx.term()
    checker.join(10)
    assert woke <= 2, f"the idle token checker woke up {woke} times in 1.5 s"
    assert not checker.is_alive() and not os.path.exists(folder)


def _no_zap_threads() -> bool:
    import threading

    for _ in range(100):
        if not [t for t in threading.enumerate() if t.name == "vlserve-zap" and t.is_alive()]:
            return True
        time.sleep(0.05)
    return False


def _my_folders(prefix: str) -> list[str]:
    return [n for n in os.listdir(runtime_dir()) if n.lstrip(".").startswith(f"{prefix}{os.getpid()}-")]


def test_a_leader_that_fails_to_start_leaves_no_thread_or_folder(monkeypatch):
    import torch

    from vlserve.engine.tp import leader

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert _no_zap_threads() and _my_folders("vlserve-ranks-") == []

    def fail(*args):
        raise RuntimeError("no such device")

    monkeypatch.setattr(leader, "device_for", fail)
    cfg = NS(tensor_parallel_size=2, device=torch.device("cpu"), args=None, num_kv_blocks=8)
    with pytest.raises(RuntimeError, match="no such device"):
        leader.TPLeader.start(cfg)
    assert _no_zap_threads(), "the failed start left its token checker running"
    assert _my_folders("vlserve-ranks-") == [], "the failed start left its private folder"


def test_a_client_that_fails_to_start_its_engine_leaves_no_thread_or_folder(monkeypatch):
    import asyncio

    from vlserve.engine import core_client
    from vlserve.engine.private_sockets import PrivateSockets

    assert _no_zap_threads() and _my_folders("vlserve-ipc-") == []
    bind = PrivateSockets.bind

    def bind_twice(self, sock, name):
        if name == "heartbeat":
            raise OSError("address in use")
        return bind(self, sock, name)

    monkeypatch.setattr(PrivateSockets, "bind", bind_twice)
    client = core_client.EngineCoreClient(None, None)
    with pytest.raises(OSError, match="address in use"):
        asyncio.run(client.start())
    assert _no_zap_threads(), "the failed start left its token checker running"
    assert _my_folders("vlserve-ipc-") == [], "the failed start left its private folder"
