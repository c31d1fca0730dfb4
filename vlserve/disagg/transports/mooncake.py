"""The Mooncake transfer engine (TCP here, RDMA where the hardware has it): the language server registers its
receive buffers once; the encoder writes each chunk into the named blocks with one batch of remote writes, then
sends the header alone over the control connection.

Metadata goes through Mooncake's own peer-to-peer handshake (no etcd, no metadata server): a receiver is
addressed by the "host:port" of its transfer engine, which travels in the request's `TransferTarget`.
"""

from __future__ import annotations

import asyncio
import threading

import torch
import zmq.asyncio

from vlserve.core.wire import Framer
from vlserve.disagg.messages import EncoderToLanguage, TransferChunk, TransferTarget
from vlserve.disagg.transports.base import (
    ChunkData,
    Transport,
    check_chunk,
    check_target,
    chunk_row_tokens,
    header_nbytes,
)
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers

PROTOCOL = "tcp"  # "rdma" needs RDMA NICs; the engine is the same
STAGING_BYTES = 64 * 2**20  # registered once; a bigger chunk gets a bigger staging buffer


def mooncake_engine_class():
    """Mooncake's TransferEngine class, or ImportError saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"--transfer-backend mooncake needs the Mooncake transfer engine "
                          f"(pip install mooncake-transfer-engine-non-cuda; Debian: apt-get install libibverbs1): "
                          f"{e}") from None
    return TransferEngine


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self.framer = Framer(EncoderToLanguage)
        self.engine = mooncake_engine_class()()
        if self.engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise RuntimeError(f"the Mooncake transfer engine could not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []  # kept alive while registered
        self._staging: torch.Tensor | None = None
        self._lock = threading.Lock()  # one batch at a time through the staging buffer

    def _register(self, region: torch.Tensor) -> None:
        if self.engine.register_memory(region.data_ptr(), region.numel()) != 0:
            raise RuntimeError("the Mooncake transfer engine could not register memory")
        self._registered.append(region)

    # ---- receiver --------------------------------------------------------------------------------------------
    def target(self, buffers: TransferBuffers) -> TransferTarget:
        self._register(buffers.storage)
        return TransferTarget(self.name, buffers.layout, self.session, buffers.storage.data_ptr())

    def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> int:
        if header.fill_ids is not None or header.rows is not None or len(frames) > 1:
            raise ValueError("a Mooncake chunk is written in place; it must not carry tensor frames")
        return header_nbytes(header, buffers.layout)

    # ---- sender ----------------------------------------------------------------------------------------------
    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData,
                   target: TransferTarget | None) -> int:
        target = check_target(target, self.name)
        check_chunk(header, data, target.layout.width)
        await asyncio.get_running_loop().run_in_executor(None, self._write, header, data, target)
        await sock.send_multipart([peer, *self.framer.encode(header)], copy=False)
        return data.nbytes

    def _write(self, header: TransferChunk, data: ChunkData, target: TransferTarget) -> None:
        layout, offsets = target.layout, target.layout.offsets()
        rows = data.rows.to(DTYPES[layout.dtype]).contiguous()
        arrays = [("fill_ids", data.fill_ids.to(torch.int64).contiguous(), torch.arange(header.num_tokens)),
                  ("positions", data.positions.to(torch.int64).contiguous(), torch.arange(header.num_tokens)),
                  ("embeddings", rows, chunk_row_tokens(header))]
        table = torch.tensor(header.block_ids, dtype=torch.int64)
        span = len(header.block_ids) * layout.block_tokens
        with self._lock:
            staging = self._staging_for(sum(a.numel() * a.element_size() for _, a, _ in arrays))
            src, dst, lengths, at = [], [], [], 0
            for name, values, tokens in arrays:
                if not values.numel():
                    continue
                if int(tokens.max()) >= span or int(tokens.min()) < 0:
                    raise ValueError(f"the chunk runs past the {span} slots of its blocks")
                flat = values.view(torch.uint8).view(values.shape[0], -1)
                row_bytes = flat.shape[1]
                staging[at : at + flat.numel()].view(-1, row_bytes).copy_(flat)
                slots = table[tokens // layout.block_tokens] * layout.block_tokens + tokens % layout.block_tokens
                base = target.base_address + offsets[name]
                for first, count in _runs(slots):  # consecutive slots are one contiguous write
                    src.append(staging.data_ptr() + at + first[0] * row_bytes)
                    dst.append(base + first[1] * row_bytes)
                    lengths.append(count * row_bytes)
                at += flat.numel()
            if self.engine.batch_transfer_sync_write(target.session, src, dst, lengths) != 0:
                raise RuntimeError(f"the Mooncake write to {target.session} failed")

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, STAGING_BYTES), dtype=torch.uint8)
            self._register(self._staging)
        return self._staging

    def close(self) -> None:
        for region in self._registered:
            self.engine.unregister_memory(region.data_ptr())
        self._registered.clear()


def _runs(slots: torch.Tensor):
    """((index in the chunk, first slot), length) of each run of consecutive slots."""
    values = slots.tolist()
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            yield (start, values[start]), i - start
            start = i
