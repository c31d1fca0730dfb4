"""ZeroMQ: the sender writes a chunk's rows into the receiver's blocks over a socket of its own (the receiver's
row socket), then sends the header alone over the control connection, like every transport that writes in place.

The row socket is served by a thread of whichever process holds the blocks: a decode engine serves its KV cache
(a socket for each rank's file; on a GPU the receive blocks it reads), so no front end sees a KV byte; any other
receiver its
receive blocks. Each write is one message (a `RowWrite` header and the rows' bytes) answered once the rows are
in the blocks; the sender waits for that answer before it sends the chunk's header, and fails fast when the
receiver cannot be reached. The receiver takes a write only into blocks it reserved for that write's transfer
(its grant: engine.write_grants, kept by whichever allocates them in this process; buffers nobody here grants
take no write at all), and checks it as shm checks a mapped one (exactly the bytes the rows need); a decode
engine's socket (`check_finite`) also refuses rows holding NaN or inf, since it copies them anyway. It also
refuses a write that comes too late by its own clock (the sender's send time plus the write timeout every role
shares, less a margin), so a write given up on never lands. A refused write is answered with why, a malformed
header or one over its size bound too; only a message bigger than the blocks themselves (libzmq's MAXMSGSIZE, at
least 64 MiB) drops its connection unanswered, and the sender's write fails at its timeout. On loopback the
socket is a Unix socket in a folder only this user can enter; elsewhere TCP, with --disagg-secret required
(CurveZMQ, like the control channel).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import warnings

import msgspec
import torch
import zmq

from vlserve.core.errors import ConfigurationError
from vlserve.core.private_dirs import PrivateDir
from vlserve.disagg.auth import PeerAuth, is_loopback
from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import Transport, check_run, write_run, write_timeout_s
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers, all_finite

logger = logging.getLogger("vlserve.disagg.zmq")
POLL_MS = 200  # how often the serving thread looks whether it should stop
MAX_IDLE_SOCKETS = 4  # connections kept per receiver for the next writes
MAX_RECEIVERS = 64  # receivers whose idle connections are kept (least recently used go first)
CONNECT_TIMEOUT_S = 2.0  # a receiver that cannot be reached fails its write this soon
LATE_MARGIN_S = 1.0
CLOCK_SKEW_S = 5.0  # a write sent (by its sender's clock) further in the future than this is refused
HEADER_BYTES = 65536  # a header's size beyond its block ids (a few bytes each)
MIN_MESSAGE_BYTES = 64 * 2**20  # what libzmq lets in per frame at least: anything smaller gets an answer


class RowWrite(msgspec.Struct, array_like=True):
    """Rows for the run `block_ids`, from its first slot; the rows' bytes follow as the next frame."""

    write_id: int
    grant: str  # the transfer's grant (`TransferTarget.grant`): the blocks must be reserved under it
    block_ids: list[int]
    num_rows: int
    sent_at: float  # unix time, the sender's clock: it gives up `write_timeout_s()` later


class RowWritten(msgspec.Struct, array_like=True):
    write_id: int
    error: str = ""  # why the receiver refused the write ("": the rows are in its blocks)


class RowServer:
    """The receiver's row socket: a thread that puts each write's rows into `buffers` and answers it.

    On a loopback address (peers on this machine) it is a Unix socket in a folder of this user's only, so no
    other user of the machine can write into the blocks; on any other address it listens on every interface (the
    address may be a name, or translated on the way: a container's) and only with --disagg-secret, which it then
    requires of every peer."""

    def __init__(self, buffers: TransferBuffers, host: str, auth: PeerAuth, check_finite: bool = False):
        """`check_finite`: refuse a write whose rows are not all finite. Only where every row is a value: not a
        hybrid model's KV (its state rows are float32 bytes, checked by the engine), nor a front end's media rows
        (it checks them itself)."""
        self.buffers, self.auth, self.check_finite = buffers, auth, check_finite
        self.write_timeout = write_timeout_s()  # how long after its send time a sender waits for a write
        self._stop, self._thread, self._folder = threading.Event(), None, None
        local = is_loopback(host)  # the one rule every channel follows
        if not local and not auth.enabled:
            raise ConfigurationError(f"the zmq row socket would listen on {host} without --disagg-secret: set it on "
                                     "every role, or use a loopback address")
        self.ctx = zmq.Context()  # its own: the socket belongs to the serving thread
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        # No frame bigger than the blocks themselves (a smaller one, an oversized header too, is answered), and
        # few messages queued per peer before TCP pushes back.
        self.max_header = HEADER_BYTES + 10 * buffers.layout.num_blocks
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(buffers.layout.nbytes, MIN_MESSAGE_BYTES) + HEADER_BYTES)
        self.sock.rcvhwm = 2
        auth.secure_server(self.sock)
        try:
            if local:
                # mode 0700; killed receivers' folders are swept first
                self._folder = PrivateDir("vlserve-rows-")
                self.address = f"ipc://{self._folder.path}/rows"
                self.sock.bind(self.address)
            else:
                self.address = f"tcp://{host}:{self.sock.bind_to_random_port('tcp://*')}"
        except zmq.ZMQError as e:
            self.close()
            raise ConfigurationError(f"the zmq transport cannot listen for rows ({host}): {e}") from None
        self._decoder = msgspec.msgpack.Decoder(RowWrite)
        self._thread = threading.Thread(target=self._serve, name="vlserve-zmq-rows", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(POLL_MS):
                    continue
                frames = self.sock.recv_multipart(copy=False)
                reply = self._handle(frames)
                self.sock.send_multipart([frames[0].bytes, msgspec.msgpack.encode(reply)])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self.sock.close(0)  # by this thread: no copy can be under way

    def _handle(self, frames: list) -> RowWritten:
        if len(frames) != 3:
            return RowWritten(0, f"a row write is a header and the rows: got {len(frames) - 1} frames")
        write_id = 0
        if len(frames[1]) > self.max_header:
            return RowWritten(0, f"a row write's header has {len(frames[1])} bytes, at most {self.max_header}: "
                                 "nothing written")
        try:
            msg = self._decoder.decode(frames[1].buffer)
            write_id = msg.write_id
            self._write(msg, frames[2].buffer)
        except (msgspec.DecodeError, ValueError) as e:
            return RowWritten(write_id, str(e) or type(e).__name__)
        except Exception as e:  # noqa: BLE001 - the serving thread must outlive any one write
            logger.exception("a row write failed")
            return RowWritten(write_id, f"the receiver could not write the rows: {type(e).__name__}")
        return RowWritten(write_id)

    def _write(self, msg: RowWrite, data: memoryview) -> None:
        # Taken only while its copy surely ends before the sender gives up, by this receiver's clock and timeout:
        # a write given up on never lands (the clocks must agree within the margin less the copy). Released
        # blocks take no write at all anyway (the grant).
        timeout, now = self.write_timeout, time.time()
        if not (math.isfinite(msg.sent_at) and msg.sent_at <= now + CLOCK_SKEW_S):
            raise ValueError(f"the write's send time {msg.sent_at!r} is not a time of now: nothing written")
        if now > msg.sent_at + timeout - late_margin_s(timeout):
            raise ValueError("the write came too late (its sender stops waiting for it soon): nothing written")
        layout = self.buffers.layout
        dtype = DTYPES[layout.dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if msg.num_rows <= 0 or data.nbytes != msg.num_rows * layout.width * itemsize:
            raise ValueError(f"{msg.num_rows} rows of width {layout.width} ({layout.dtype}) need "
                             f"{msg.num_rows * layout.width * itemsize} bytes, the write has {data.nbytes}")
        with warnings.catch_warnings():  # read only: the rows are copied into the blocks, never written
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.frombuffer(data, dtype=dtype).view(msg.num_rows, layout.width)
        check_run(layout, msg.block_ids, rows)  # inside the blocks
        grants = self.buffers.grants
        if grants is None:  # nobody here gives these blocks out: none is reserved for any transfer
            raise ValueError("this receiver grants none of its blocks to peers' writes: nothing written")
        with grants.writing(msg.grant, msg.block_ids):  # reserved for this transfer, and kept until it is done
            if self.check_finite and not all_finite(rows):  # one pass, as the rows are about to be copied anyway
                raise ValueError("the rows hold NaN or infinite values: nothing written")
            write_run(self.buffers, msg.block_ids, rows)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join()  # within a poll period and a copy; it closes its own socket
        else:
            self.sock.close(0)
        self.auth.stop()
        self.ctx.term()
        if self._folder is not None:
            self._folder.remove()


def late_margin_s(timeout: float) -> float:
    """How long before its sender gives up a write is no longer taken: room for the copy and for clocks that
    differ (a second, less for a short timeout)."""
    return min(LATE_MARGIN_S, timeout / 4)


class ZmqTransport(Transport):
    name = "zmq"

    copies_rows_in = True

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None, check_finite: bool = False):
        """`check_finite`: its row sockets refuse rows holding NaN or inf (`RowServer`)."""
        super().__init__(host, secret)
        self.secret, self._client_auth, self.check_finite = secret, PeerAuth(secret), check_finite
        self.write_timeout = write_timeout_s()  # below the receiver's quarantine of a failed transfer's blocks
        self._servers: list[RowServer] = []
        self._idle: dict[str, list[zmq.Socket]] = {}  # receiver address -> connected sockets not in use
        self._lock = threading.Lock()  # writes run on several threads at once
        self._closed = False
        self._ids = itertools.count(1)

    # ---- receiver --------------------------------------------------------------------------------------------
    def target(self, buffers: TransferBuffers) -> TransferTarget:
        server = RowServer(buffers, self.host, PeerAuth(self.secret), self.check_finite)
        self._servers.append(server)
        return TransferTarget(self.name, buffers.layout, server.address)

    # ---- sender ----------------------------------------------------------------------------------------------
    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        layout = target.layout
        if first_row or first_plane:
            raise ValueError("the zmq transport writes whole rows from the run's first slot only")
        if not rows.shape[0]:
            return 0
        if rows.dim() != 2 or rows.shape[1] != layout.width:
            raise ValueError(f"{tuple(rows.shape)} rows do not have the receiver's width {layout.width}")
        data = rows.to(DTYPES[layout.dtype]).contiguous()
        write_id, sock = next(self._ids), self._socket(target.session)
        done, now = False, time.time()
        try:
            if not sock.poll(min(CONNECT_TIMEOUT_S, self.write_timeout) * 1000, zmq.POLLOUT):
                raise ConnectionError(f"the receiver {target.session} cannot be reached")
            header = RowWrite(write_id, target.grant, list(block_ids), data.shape[0], now)
            sock.send_multipart([msgspec.msgpack.encode(header), data.view(torch.uint8).numpy()], copy=False)
            if not sock.poll(max(0.0, now + self.write_timeout - time.time()) * 1000):
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
                self._forget(target.session)  # its other connections are likely as broken
        if reply.error:
            raise ValueError(f"the receiver refused the rows: {reply.error}")
        return data.numel() * data.element_size()

    def _socket(self, address: str) -> zmq.Socket:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"a zmq target names no row socket ({address!r}): start every role with the same "
                             "vlserve version and backend")
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        # The process's shared context: never terminated, so a transport nobody closed cannot hang a collection.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.immediate = True  # sendable only once connected: an unreachable receiver fails fast
        self._client_auth.secure_client(sock)
        sock.connect(address)
        return sock

    def _give_back(self, address: str, sock: zmq.Socket) -> None:
        gone: list[zmq.Socket] = []
        with self._lock:
            idle = self._idle.pop(address, [])
            self._idle[address] = idle  # the most recently used last
            if len(idle) < MAX_IDLE_SOCKETS and not self._closed:
                idle.append(sock)
                sock = None
            while len(self._idle) > MAX_RECEIVERS:
                gone += self._idle.pop(next(iter(self._idle)))
        for other in gone + ([sock] if sock is not None else []):
            other.close(0)

    def _forget(self, address: str) -> None:
        with self._lock:
            gone = self._idle.pop(address, [])
        for sock in gone:
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
