"""A sender and a receiver of one transport in one process, over a real ZeroMQ connection: what the transport
tests and the bandwidth benchmark drive. The receiver side is what a receiving server (language, prefill or
decode) does with a chunk."""

from __future__ import annotations

import msgspec
import torch
import zmq
import zmq.asyncio

from vlserve.core.wire import Framer
from vlserve.disagg.messages import SenderToReceiver, RowSegment, TransferChunk, TransferTarget
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.transports.base import ChunkData, ChunkTokens
from vlserve.engine.transfer_buffers import TransferBuffers


class Loopback:
    def __init__(self, backend: str, buffers: TransferBuffers):
        self.buffers = buffers
        self.receiver = TRANSPORTS[backend]("127.0.0.1")
        self.sender = TRANSPORTS[backend]("127.0.0.1")
        self.target: TransferTarget | None = msgspec.structs.replace(self.receiver.target(buffers), grant="loopback")
        if buffers.grants is not None:  # every block reserved for the one transfer these chunks belong to
            buffers.grants.open("loopback", range(buffers.num_blocks))
        ctx = zmq.asyncio.Context.instance()
        self.router = ctx.socket(zmq.ROUTER)  # the sender's socket
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = ctx.socket(zmq.DEALER)  # the receiver's
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.framer = Framer(SenderToReceiver)
        self.peer: bytes | None = None

    async def connect(self) -> None:
        await self.dealer.send(b"hello")
        self.peer, _ = await self.router.recv_multipart()

    async def transfer(self, header: TransferChunk, data: ChunkData,
                       target: TransferTarget | None = None) -> ChunkTokens:
        """Send one chunk and handle it as the receiver would; returns what the receiver got beside the rows."""
        await self.sender.send(self.router, self.peer, header, data, target or self.target)
        frames = await self.dealer.recv_multipart(copy=False)
        frames = [f.buffer for f in frames]
        return await self.receiver.receive(self.framer.decode(frames), frames, self.buffers)

    def close(self) -> None:
        self.router.close(0)
        self.dealer.close(0)
        self.sender.close()
        self.receiver.close()


def media_chunk(block_ids: list[int], block_tokens: int, num_tokens: int, media: tuple[int, int], width: int,
                dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[TransferChunk, ChunkData]:
    """A chunk of `num_tokens` prompt tokens whose tokens media[0]..media[1] carry embedding rows (in the run's
    first slots)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = media
    header = TransferChunk("r", 1, 0, num_tokens, num_tokens, 0, [], block_ids, [RowSegment(lo, hi - lo)],
                           partial=False)
    data = ChunkData(torch.randint(0, 1000, (num_tokens,), generator=g),
                     torch.randint(0, 100, (num_tokens, 3), generator=g),
                     torch.randn(hi - lo, width, generator=g).to(dtype))
    return header, data
