"""The transport interface: the sender delivers a chunk into the receiver's blocks by block id, the receiver
makes sure the chunk's data is in those blocks when the header is handled.

ZeroMQ carries the data as frames after the header and the receiver copies them into its blocks. A transport
with direct access to the receiver's memory (shared memory on one host, the Mooncake transfer engine) writes
straight into the blocks named by the header and sends the header alone; `receive` then only checks it. The
block layout (engine.transfer_buffers) is the contract both sides share; the receiver describes its buffers
once (`target`), and every request carries that description to the sender (an encoder or a prefill instance).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import zmq.asyncio

from vlserve.core.processes import finish
from vlserve.core.wire import Framer
from vlserve.disagg.messages import SenderToReceiver, TransferChunk, TransferTarget
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers


@dataclass
class ChunkData:
    """What one chunk moves: every token's fill id and positions, and embedding rows for its media tokens."""

    fill_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n, 3] int64
    rows: torch.Tensor  # [m, width], in the order of the header's segments (m may be 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fill_ids, self.positions, self.rows))


ABORT_ACK_STATUS = 499  # a sender's TransferFailed answering AbortTransfer: nothing more is written


class Transport(ABC):
    name: str
    writes_in_place = False  # the sender writes the receiver's blocks: after a failure they wait for its word
    maps_receiver_file = False  # senders open the receive buffers' file by name: it must keep its name

    def __init__(self, host: str = "127.0.0.1"):
        """`host`: this process's address as peers reach it (transports with their own listener use it)."""
        self.host = host

    def target(self, buffers: TransferBuffers) -> TransferTarget | None:
        """Receiver side, once: what a sender needs to write into `buffers` (None: it sends frames)."""
        return None

    @abstractmethod
    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData,
                   target: TransferTarget | None) -> int:
        """Sender side: deliver `data` into the receiver's `header.block_ids`; returns the payload bytes."""

    @abstractmethod
    async def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> int:
        """Receiver side: after this the chunk's data is in `header.block_ids` (a run starting at token
        `header.start_token`); returns the payload bytes. Raises ValueError for a malformed chunk. A copy that
        grows with the chunk runs off the event loop (`in_thread`)."""

    def close(self) -> None:
        pass


class InPlaceTransport(Transport):
    """A transport that writes the receiver's blocks itself (`write`); only the header travels."""

    writes_in_place = True

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self.framer = Framer(SenderToReceiver)

    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData,
                   target: TransferTarget | None) -> int:
        target = check_target(target, self.name)
        check_chunk(header, data, target.layout.width)
        await self.write(header, data, target)
        await sock.send_multipart([peer, *self.framer.encode(header)], copy=False)
        return data.nbytes

    @abstractmethod
    async def write(self, header: TransferChunk, data: ChunkData, target: TransferTarget) -> None:
        """Puts the chunk into the receiver's blocks (off the event loop: `in_thread`); done when it returns."""

    async def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> int:
        if header.fill_ids is not None or header.rows is not None or len(frames) > 1:
            raise ValueError(f"a {self.name} chunk is written in place; it must not carry tensor frames")
        return header_nbytes(header, buffers.layout)


async def in_thread(fn, *args):
    """`fn(*args)` on a worker thread, so a copy that grows with a request never holds up the event loop. A
    caller cancelled meanwhile still returns only once `fn` has ended, then raises CancelledError: a write into
    receive blocks must land before anyone may free those blocks or say that nothing more is written."""
    return await finish(asyncio.get_running_loop().run_in_executor(None, fn, *args))


def reachable_host(host: str, toward: str | None = None) -> str:
    """The address peers reach this host by. A wildcard bind address names no host: then the address of the
    interface that routes to `toward` (the registry, which every peer reaches too), else the host name's."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    import socket

    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((toward, 9))  # UDP: picks the route, sends nothing
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def check_target(target: TransferTarget | None, backend: str) -> TransferTarget:
    if target is None or target.backend != backend:
        have = "frames (zmq)" if target is None else target.backend
        raise ValueError(f"this peer sends with --transfer-backend {backend}, the receiver expects "
                         f"{have}: start every role with the same backend")
    return target


def write_chunk(buffers: TransferBuffers, header: TransferChunk, data: ChunkData) -> None:
    """The chunk's data into the receiver's run, by token index (shared by every transport that copies)."""
    run = header.block_ids
    check_chunk(header, data, buffers.layout.width)
    buffers.write_tokens(run, 0, data.fill_ids, data.positions)
    tokens = chunk_row_tokens(header)
    if tokens.numel():
        buffers.write_rows(run, tokens, data.rows)


def check_chunk(header: TransferChunk, data: ChunkData, width: int) -> None:
    if data.fill_ids.shape != (header.num_tokens,):
        raise ValueError(f"a chunk of {header.num_tokens} tokens carries {tuple(data.fill_ids.shape)} fill ids")
    rows = sum(s.num_rows for s in header.segments)
    if data.rows.numel() and (data.rows.dim() != 2 or data.rows.shape[1] != width):
        raise ValueError(f"embedding rows must be [{rows}, {width}], got {tuple(data.rows.shape)}")
    if (data.rows.shape[0] if data.rows.numel() else 0) != rows:
        raise ValueError(f"the segments name {rows} embedding rows, the chunk carries {tuple(data.rows.shape)}")


def chunk_row_tokens(header: TransferChunk) -> torch.Tensor:
    """Run token index of each embedding row of the chunk, in row order."""
    parts = [torch.arange(s.token, s.token + s.num_rows) for s in header.segments]
    return (torch.cat(parts) - header.start_token) if parts else torch.empty(0, dtype=torch.int64)


def header_nbytes(header: TransferChunk, layout) -> int:
    """The payload a header-only chunk stands for (what a frame transport would have carried)."""
    itemsize = torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
    rows = sum(s.num_rows for s in header.segments)
    return header.num_tokens * 4 * 8 + rows * layout.width * itemsize
