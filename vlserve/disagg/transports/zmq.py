"""ZeroMQ/TCP: the chunk's tensors (rows too) travel as raw frames after its header on the control connection."""

from __future__ import annotations

import torch
import zmq.asyncio

from vlserve.core.wire import Framer, tensor_from, tensor_ref
from vlserve.disagg.messages import SenderToReceiver, TransferChunk, TransferTarget
from vlserve.disagg.transports.base import ChunkData, ChunkTokens, Transport, chunk_tokens, in_thread, write_chunk
from vlserve.engine.transfer_buffers import TransferBuffers


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self.framer = Framer(SenderToReceiver)

    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData,
                   target: TransferTarget | None) -> int:
        tensors: list[torch.Tensor] = []
        header.fill_ids = tensor_ref(data.fill_ids, tensors)
        header.positions = tensor_ref(data.positions, tensors)
        header.rows = tensor_ref(data.rows, tensors)
        await sock.send_multipart([peer, *self.framer.encode(header, tensors)], copy=False)
        return data.nbytes

    async def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> ChunkTokens:
        return await in_thread(self._receive, header, frames, buffers)

    def _receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> ChunkTokens:
        if header.rows is None:
            raise ValueError("a ZeroMQ chunk must carry its rows as frames")
        fill_ids, positions = chunk_tokens(header, frames)
        data = ChunkData(fill_ids, positions, tensor_from(header.rows, frames))
        if data.rows.dim() != 2 or not data.rows.is_floating_point():
            raise ValueError("rows must be a 2-D float tensor")
        write_chunk(buffers, header, data)
        return ChunkTokens(fill_ids, positions, data.nbytes)
