"""Who can reach the tensor-parallel ranks over the network (issue #78): ranks of one machine listen on loopback
only, whatever interface gloo would pick by itself; ranks on several machines reach rank 0's control socket over
TCP encrypted, never with the token or a step in clear, and still serve."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import socket_inodes

LOOPBACK_FLAG, UP_FLAG = 0x8, 0x1  # IFF_LOOPBACK, IFF_UP


class _Relay:
    """A TCP relay in front of `port` that keeps every byte it passes on (what a listener on the wire sees)."""

    def __init__(self, port: int):
        import threading

        self.seen = bytearray()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]

        def pump(src, dst):
            try:
                while data := src.recv(65536):
                    self.seen.extend(data)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                dst.close()

        def serve():
            while True:
                try:
                    client, _ = self._server.accept()
                except OSError:
                    return
                upstream = socket.create_connection(("127.0.0.1", port))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pump, args=(a, b), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        self._server.close()


def test_the_control_socket_of_ranks_on_other_machines_is_encrypted(monkeypatch):
    """Ranks on several machines reach rank 0 over TCP: neither the token nor a step crosses the wire in clear
    (before: ZeroMQ PLAIN sent the token, then every message, as they are), and a peer without the token, or one
    that offers it in clear, is refused."""
    import secrets

    import zmq

    from vlserve.engine.private_sockets import PrivateSockets, connect_private
    from vlserve.engine.tp.leader import bind_control
    from vlserve.engine.tp.placement import Placement

    monkeypatch.setenv("VLSERVE_TP_HOST", "127.0.0.1")
    ctx = zmq.Context()
    private = PrivateSockets(ctx, "vlserve-ranks-")
    socks = [ctx.socket(zmq.ROUTER)]
    relay = None
    try:
        router = socks[0]
        address = bind_control(private, router, Placement(0, 2, 0, 1, "env://"))
        assert address.startswith("tcp://127.0.0.1:"), address
        relay = _Relay(int(address.rsplit(":", 1)[1]))
        rank = ctx.socket(zmq.DEALER)
        socks.append(rank)
        rank.identity = b"rank-1"
        connect_private(rank, f"tcp://127.0.0.1:{relay.port}", private.token)
        step, answer = f"step-{secrets.token_hex(8)}".encode(), f"answer-{secrets.token_hex(8)}".encode()
        rank.send(step)
        assert router.poll(60000), "the rank holding the token was not served"
        assert router.recv_multipart() == [b"rank-1", step]
        router.send_multipart([b"rank-1", answer])
        assert rank.poll(60000) and rank.recv() == answer
        for what in ("token", "step", "answer"):
            assert {"token": private.token.encode(), "step": step, "answer": answer}[what] not in relay.seen, \
                f"the {what} crossed the wire in clear"
        in_clear, guessing = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        socks += [in_clear, guessing]
        in_clear.plain_username, in_clear.plain_password = b"vlserve", private.token.encode()
        in_clear.connect(address)
        connect_private(guessing, address, secrets.token_hex(32))
        for sock in (in_clear, guessing):
            if sock.poll(2000, zmq.POLLOUT):
                # (its refused handshake may drop the connection between the poll and the send: then nothing goes)
                with contextlib.suppress(zmq.Again):
                    sock.send(b"forged", zmq.NOBLOCK)
        assert not router.poll(2000), "a peer without the token (or offering it in clear) was served"
    finally:
        if relay is not None:
            relay.close()
        for sock in socks:
            sock.close(linger=0)
        private.close()
        ctx.term()


# ---- ranks of one machine ---------------------------------------------------------------------------------------
def _outward_interface() -> str | None:
    """An interface that is up, not loopback, and has an IPv4 address (what gloo may pick by itself)."""
    import fcntl
    import struct

    for name in sorted(os.listdir("/sys/class/net")):
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & LOOPBACK_FLAG or not flags & UP_FLAG:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                return name
            except OSError:
                continue
    return None


def _family_pids() -> list[int]:
    """This process and its children (the ranks it started)."""
    pids = [os.getpid()]
    for task in os.listdir("/proc/self/task"):
        try:
            pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return pids


def _tcp_listeners(pids: list[int]) -> dict[str, str]:
    """socket inode -> the address it listens on, for these processes' listening TCP sockets."""
    inodes = socket_inodes(pids)
    found = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local rem st ... uid timeout inode
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: listening
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host order
            found[fields[9]] = socket.inet_ntop(family, raw)
    return found


def test_ranks_of_one_machine_listen_on_loopback_only(tiny_ckpt, monkeypatch):
    """gloo listens where the host name resolves, or on GLOO_SOCKET_IFNAME when set (e.g. for other jobs): an
    address other machines reach, with nothing to authenticate a peer. Ranks that all run here use loopback."""
    from vlserve import LLM, SamplingParams

    outward = _outward_interface()
    if outward is None:
        pytest.skip("no network interface other than loopback with an IPv4 address")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", outward)  # what would make gloo listen outward
    before = set(_tcp_listeners([os.getpid()]))
    llm = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        listening = {inode: address for inode, address in _tcp_listeners(_family_pids()).items()
                     if inode not in before}
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    outside = sorted(a for a in listening.values() if not ipaddress.ip_address(a).is_loopback)
    assert outside == [], f"tensor-parallel ranks listen on {outside}, reachable from other machines"
    assert os.environ["GLOO_SOCKET_IFNAME"] == outward, "the process's own setting was not given back"


# ---- ranks on several machines ----------------------------------------------------------------------------------
def test_ranks_on_two_machines_meet_over_the_encrypted_socket(tiny_ckpt):
    """Two processes told (torchrun's variables) that they run on two machines: rank 0 binds its control socket on
    TCP, rank 1 connects with the token it got over the process group, and the answer is the single-device one."""
    path = str(tiny_ckpt("qwen2_vl"))
    demo = [sys.executable, "-m", "vlserve", "demo", "--model", path, "--dtype", "float32", "--max-tokens", "8",
            "--num-kv-blocks", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(demo, capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([*demo, "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True,
                              env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "VLSERVE_TP_HOST": "127.0.0.1"})
             for rank in (0, 1)]
    try:
        outs = [r.communicate(timeout=300) for r in ranks]
    finally:
        for r in ranks:
            if r.poll() is None:
                os.killpg(r.pid, 9)
                r.wait()
    assert [r.returncode for r in ranks] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[0][0].splitlines()[-1] == one.stdout.splitlines()[-1]
    assert "running as a tensor-parallel worker" in outs[1][1]
