"""ZeroMQ/TCP: the sender writes a chunk's rows into the receiver's blocks over a socket of its own (the
receiver's row socket), then sends the header alone over the control connection, like every transport that writes
in place.

The row socket is served by a thread of whichever process holds the blocks: a decode engine on one CPU serves its
KV cache (the front end never sees a KV byte), any other receiver its receive blocks. Each write is one message
(a `RowWrite` header and the rows' bytes) answered once the rows are in the blocks; the sender waits for that
answer before it sends the chunk's header. The receiver checks every write as shm checks a mapped one (inside
its blocks, exactly the bytes the rows need) and refuses one that arrives after the sender stopped waiting for
it (`not_after`, the sender's clock), so a write given up on never lands in blocks the receiver has since given
to another request. With --disagg-secret the row socket is CurveZMQ like the control channel.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket as socket_module
import threading
import time
import warnings

import msgspec
import torch
import zmq

from vlserve.core.errors import ConfigurationError
from vlserve.disagg.auth import PeerAuth
from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import Transport, write_run, write_timeout_s
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers

logger = logging.getLogger("vlserve.disagg.zmq")
POLL_MS = 200  # how often the serving thread looks whether it should stop
MAX_IDLE_SOCKETS = 4  # connections kept per receiver for the next writes


class RowWrite(msgspec.Struct, array_like=True):
    """Rows for the run `block_ids`, from its first slot; the rows' bytes follow as the next frame."""

    write_id: int
    block_ids: list[int]
    num_rows: int
    not_after: float  # unix time: the sender has given up on this write by then


class RowWritten(msgspec.Struct, array_like=True):
    write_id: int
    error: str = ""  # why the receiver refused the write ("": the rows are in its blocks)


class RowServer:
    """The receiver's row socket: a thread that puts each write's rows into `buffers` and answers it."""

    def __init__(self, buffers: TransferBuffers, host: str, auth: PeerAuth):
        self.buffers, self.auth = buffers, auth
        interface = _interface(host)
        if interface == "*" and not auth.enabled:
            raise ConfigurationError(f"the zmq row socket would listen on {host} without --disagg-secret: set it on "
                                     "every role, or use a loopback address")
        self.ctx = zmq.Context()  # its own: the socket belongs to the serving thread
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        # No frame bigger than the blocks themselves: a peer cannot make this process buffer more.
        self.sock.setsockopt(zmq.MAXMSGSIZE, buffers.layout.nbytes + 65536)
        auth.secure_server(self.sock)
        try:
            port = self.sock.bind_to_random_port(f"tcp://{interface}")
        except zmq.ZMQError as e:
            self.close()
            raise ConfigurationError(f"the zmq transport cannot listen on {host}: {e}") from None
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(RowWrite)
        self._thread = threading.Thread(target=self._serve, name="vlserve-zmq-rows", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.sock.poll(POLL_MS):
                    continue
                frames = self.sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # closed under us
            if len(frames) != 3:
                continue  # not a write of ours: no answer
            write_id, error = 0, ""
            try:
                msg = self._decoder.decode(frames[1].buffer)
                write_id = msg.write_id
                self._write(msg, frames[2].buffer)
            except (msgspec.DecodeError, ValueError) as e:
                error = str(e) or type(e).__name__
            except Exception as e:  # noqa: BLE001 - the serving thread must outlive any one write
                logger.exception("a row write failed")
                error = f"the receiver could not write the rows: {type(e).__name__}"
            try:
                self.sock.send_multipart([frames[0].bytes, msgspec.msgpack.encode(RowWritten(write_id, error))])
            except zmq.ZMQError:
                return

    def _write(self, msg: RowWrite, data: memoryview) -> None:
        if time.time() > msg.not_after:
            raise ValueError("the write came after its sender stopped waiting for it: nothing written")
        layout = self.buffers.layout
        dtype = DTYPES[layout.dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if msg.num_rows <= 0 or data.nbytes != msg.num_rows * layout.width * itemsize:
            raise ValueError(f"{msg.num_rows} rows of width {layout.width} ({layout.dtype}) need "
                             f"{msg.num_rows * layout.width * itemsize} bytes, the write has {data.nbytes}")
        with warnings.catch_warnings():  # read only: the rows are copied into the blocks, never written
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.frombuffer(data, dtype=dtype).view(msg.num_rows, layout.width)
        write_run(self.buffers, msg.block_ids, rows)  # checked to stay inside the blocks first

    def close(self) -> None:
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * POLL_MS / 1000)
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None):
        super().__init__(host, secret)
        self.secret = secret
        self.write_timeout = write_timeout_s()  # below the receiver's quarantine of a failed transfer's blocks
        self._servers: list[RowServer] = []
        self._idle: dict[str, list[zmq.Socket]] = {}  # receiver address -> connected sockets not in use
        self._lock = threading.Lock()  # writes run on several threads at once
        self._closed = False
        self._ids = itertools.count(1)

    # ---- receiver --------------------------------------------------------------------------------------------
    def target(self, buffers: TransferBuffers) -> TransferTarget:
        server = RowServer(buffers, self.host, PeerAuth(self.secret))
        self._servers.append(server)
        return TransferTarget(self.name, buffers.layout, server.address)

    # ---- sender ----------------------------------------------------------------------------------------------
    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor) -> int:
        layout = target.layout
        if not rows.shape[0]:
            return 0
        if rows.dim() != 2 or rows.shape[1] != layout.width:
            raise ValueError(f"{tuple(rows.shape)} rows do not have the receiver's width {layout.width}")
        data = rows.to(DTYPES[layout.dtype]).contiguous()
        write_id, sock = next(self._ids), self._socket(target.session)
        done = False
        try:
            header = RowWrite(write_id, list(block_ids), data.shape[0], time.time() + self.write_timeout)
            sock.send_multipart([msgspec.msgpack.encode(header), data.view(torch.uint8).numpy()], copy=False)
            if not sock.poll(self.write_timeout * 1000):
                raise TimeoutError(f"the receiver {target.session} did not take the rows within "
                                   f"{self.write_timeout:.0f} s")
            reply = msgspec.msgpack.decode(sock.recv(), type=RowWritten)
            if reply.write_id != write_id:
                raise RuntimeError(f"the receiver {target.session} answered another write")
            done = True
        finally:
            if done:
                self._give_back(target.session, sock)
            else:
                sock.close(0)  # a late answer must never be read as the next write's
        if reply.error:
            raise ValueError(f"the receiver refused the rows: {reply.error}")
        return data.numel() * data.element_size()

    def _socket(self, address: str) -> zmq.Socket:
        if not address.startswith("tcp://"):
            raise ValueError(f"a zmq target names no row socket ({address!r}): start every role with the same "
                             "vlserve version and backend")
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        # The process's shared context: never terminated, so a transport nobody closed cannot hang a collection.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        PeerAuth(self.secret).secure_client(sock)
        sock.connect(address)
        return sock

    def _give_back(self, address: str, sock: zmq.Socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE_SOCKETS and not self._closed:
                idle.append(sock)
                return
        sock.close(0)

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        with self._lock:
            idle, self._idle, self._closed = self._idle, {}, True
        for socks in idle.values():
            for sock in socks:
                sock.close(0)


def _interface(host: str) -> str:
    """What to bind for `host` (the address peers reach this process by): a loopback address itself (nothing
    else can reach it); any other on every interface, since it may be a name or an address translated on the way
    (a container's), and off loopback every role holds --disagg-secret, which the socket requires."""
    try:
        address = socket_module.gethostbyname(host)
    except OSError as e:
        raise ConfigurationError(f"the zmq transport cannot resolve its address {host!r}: {e}") from None
    return address if ipaddress.ip_address(address).is_loopback else "*"
