"""How encoder output rows reach the language server's blocks.

`ZmqTransport` (the default) sends a msgpack header plus the rows as raw frames over the same ZeroMQ TCP
connection that carries the control messages; the receiver scatters them into the blocks the header names.
An RDMA engine (Mooncake, NIXL) would instead write the rows straight into the receiver's registered block
memory and send only the header: callers use `send_chunk` / `read_chunk` and never see which one runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import msgspec
import torch
import zmq
import zmq.asyncio

from vlserve.core.wire import DTYPES, tensor_from_bytes
from vlserve.disagg.messages import EncoderToLanguage, LanguageToEncoder, TransferChunk


@dataclass
class Rows:
    """The payload of one chunk: per-token embedding rows, fill ids and M-RoPE positions."""

    embeddings: torch.Tensor  # [n, hidden]
    fill_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [3, n] int64


class Transport(ABC):
    name: str

    @abstractmethod
    async def send_chunk(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, rows: Rows) -> int:
        """Encoder side: deliver `rows` into the receiver's `header.block_ids`; returns payload bytes."""

    @abstractmethod
    def read_chunk(self, header: TransferChunk, frames: list) -> Rows:
        """Language side: the rows of a chunk whose header arrived with `frames`."""


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self):
        self._enc = msgspec.msgpack.Encoder()

    async def send_chunk(self, sock, peer, header, rows) -> int:
        payload = [memoryview(t.contiguous().view(torch.uint8).numpy())
                   for t in (rows.embeddings, rows.fill_ids, rows.positions)]
        await sock.send_multipart([peer, self._enc.encode(header), *payload], copy=False)
        return sum(p.nbytes for p in payload)

    def read_chunk(self, header, frames) -> Rows:
        n, dtype = header.num_tokens, DTYPES.get(header.embed_dtype)
        if dtype is None or len(frames) != 3:
            raise ValueError(f"malformed chunk for {header.request_id}")
        return Rows(tensor_from_bytes(frames[0], dtype, (n, header.hidden)),
                    tensor_from_bytes(frames[1], torch.int64, (n,)),
                    tensor_from_bytes(frames[2], torch.int64, (3, n)))


TRANSPORTS: dict[str, type[Transport]] = {"zmq": ZmqTransport}


class Codec:
    """Control-message encoding for one direction (decoders are typed: anything else is a decode error)."""

    def __init__(self):
        self.enc = msgspec.msgpack.Encoder()
        self.to_encoder = msgspec.msgpack.Decoder(LanguageToEncoder)
        self.to_language = msgspec.msgpack.Decoder(EncoderToLanguage)
