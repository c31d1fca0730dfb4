"""A prefill engine's own way into decode instances' blocks: with a transport that writes the receiver's memory
(shm, Mooncake, NIXL) the engine process writes its KV rows itself (kv_connector.RowWriter), so the front end,
which runs the transfer's protocol, passes only where to write. The destination travels to the engine process as
bytes it does not read: encoded here, decoded here."""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec
import torch

from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.transports.base import check_target


class KVDestination(msgspec.Struct, array_like=True):
    target: TransferTarget
    block_ids: list[int]


def encode_destination(target: TransferTarget | None, block_ids: list[int], backend: str) -> bytes:
    """Where a chunk's rows go, for the engine's writer; a target of another backend is refused here."""
    return msgspec.msgpack.encode(KVDestination(check_target(target, backend), block_ids))


class TransportRowWriter:
    """Made in the engine process (by the maker `row_writer_maker` returns): its own transport instance."""

    def __init__(self, backend: str, host: str):
        self.backend = backend
        self.transport = TRANSPORTS[backend](host)
        self._decoder = msgspec.msgpack.Decoder(KVDestination)

    def write(self, destination: bytes, rows: torch.Tensor) -> int:
        where = self._decoder.decode(destination)
        return self.transport.write_rows(check_target(where.target, self.backend), where.block_ids, rows)

    def close(self) -> None:
        self.transport.close()


def row_writer_maker(backend: str, host: str) -> Callable[[], TransportRowWriter] | None:
    """What the engine process makes its writer with (picklable), or None when the backend sends frames (zmq):
    then the rows go out through the front end. `host`: this instance's address as peers reach it."""
    if not TRANSPORTS[backend].writes_in_place:
        return None
    return functools.partial(TransportRowWriter, backend, host)
