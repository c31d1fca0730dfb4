"""The transport interface: the sender delivers a chunk into the receiver's blocks by block id, the receiver
makes sure the chunk's data is in those blocks when the header is handled.

ZeroMQ carries the data as frames after the header and the receiver copies them into its blocks. A transport
with direct access to the receiver's memory (shared memory on one host, an RDMA engine such as Mooncake)
writes straight into the blocks named by the header and sends the header alone; `receive` then has nothing
left to do. The block layout (engine.transfer_buffers) is the contract both sides share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import zmq.asyncio

from vlserve.disagg.messages import TransferChunk
from vlserve.engine.transfer_buffers import TransferBuffers


@dataclass
class ChunkData:
    """What one chunk moves: every token's fill id and positions, and embedding rows for its media tokens."""

    fill_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n, 3] int64
    rows: torch.Tensor  # [m, width], in the order of the header's segments (m may be 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fill_ids, self.positions, self.rows))


class Transport(ABC):
    name: str

    @abstractmethod
    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData) -> int:
        """Encoder side: deliver `data` into the receiver's `header.block_ids`; returns the payload bytes."""

    @abstractmethod
    def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> int:
        """Language side: after this the chunk's data is in `header.block_ids` (a run starting at token
        `header.start_token`); returns the payload bytes. Raises ValueError for a malformed chunk."""


def write_chunk(buffers: TransferBuffers, header: TransferChunk, data: ChunkData) -> None:
    """The chunk's data into the receiver's run, by token index (shared by every transport that copies)."""
    run, start = header.block_ids, header.start_token
    if data.fill_ids.shape != (header.num_tokens,):
        raise ValueError(f"a chunk of {header.num_tokens} tokens carries {tuple(data.fill_ids.shape)} fill ids")
    buffers.write_tokens(run, 0, data.fill_ids, data.positions)
    tokens = [torch.arange(s.token, s.token + s.num_rows) for s in header.segments]
    if tokens:
        buffers.write_rows(run, torch.cat(tokens) - start, data.rows)
    elif data.rows.numel():
        raise ValueError("embedding rows without segments")
