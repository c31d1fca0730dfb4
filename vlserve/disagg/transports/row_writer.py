"""The engine processes' own ends of the transports, so that no KV byte passes through a front end, which runs
the transfer's protocol and passes only where:
- a prefill engine writes its KV rows into decode instances' blocks itself (kv_connector.RowWriter); the
  destination travels to the engine process as bytes it does not read: encoded here, decoded here;
- a decode engine registers where prompts' KV lands (its KV cache in a shared file, or the receive buffers) with
  its own transport instance, so the writes land there (`TransportKVReceiver`; for zmq its row socket is served
  by a thread of the engine process)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import msgspec
import torch

from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports import TRANSPORTS
from vlserve.disagg.transports.base import check_target, quarantine_s, write_timeout_s


class KVDestination(msgspec.Struct, array_like=True):
    target: TransferTarget
    block_ids: list[int]


def encode_destination(target: TransferTarget | None, block_ids: list[int], backend: str) -> bytes:
    """Where a chunk's rows go, for the engine's writer; a target of another backend is refused here."""
    return msgspec.msgpack.encode(KVDestination(check_target(target, backend), block_ids))


class TransportRowWriter:
    """Made in the engine process (by the maker `row_writer_maker` returns): its own transport instance."""

    def __init__(self, backend: str, host: str, keep_s: float, secret: str | None = None, by_layer: bool = True):
        """`by_layer`: send each layer's KV as it is computed where the transport can (--kv-send-by-layer)."""
        self.backend, self.keep_s = backend, keep_s
        self.transport = TRANSPORTS[backend](host, secret)
        self.writes_layers = by_layer and self.transport.writes_layers
        self._decoder = msgspec.msgpack.Decoder(KVDestination)

    def write(self, destination: bytes, rows: torch.Tensor, first_row: int = 0, first_plane: int = 0) -> int:
        where = self._decoder.decode(destination)
        return self.transport.write(check_target(where.target, self.backend), where.block_ids, rows, first_row,
                                    first_plane)

    def planes_of(self, destination: bytes) -> int:
        return self._decoder.decode(destination).target.layout.parts

    def close(self) -> None:
        self.transport.close()


def row_writer_maker(backend: str, host: str, transfer_timeout: float, secret: str | None = None,
                     by_layer: bool = True) -> Callable[[], TransportRowWriter]:
    """What the engine process makes its writer with (picklable). `host`: this instance's address as peers
    reach it; `transfer_timeout`: how long a transfer may take (rows are kept twice that at most, a backstop for
    a send that never ended); `secret`: --disagg-secret; `by_layer`: --kv-send-by-layer."""
    return functools.partial(TransportRowWriter, backend, host, 2 * transfer_timeout + 10.0, secret, by_layer)


def send_deadline(arrived: float, within_s: float, transfer_timeout: float) -> float:
    """The `KVSend.not_after` of a prompt whose request arrived at `arrived` (time.time()): its writes, which
    start while it is computed, start within the receiver's `within_s` (`TransferRequest.write_within_s`; 0:
    an older receiver's, this instance's own `transfer_timeout`) or never. A receiver that gives up on the
    transfer earlier keeps its blocks until then, and its quarantine after it, unless this instance says sooner
    that nothing more is written (disagg.peer_client)."""
    within = within_s if 0 < within_s <= transfer_timeout else transfer_timeout  # (NaN too: the peer's word)
    return arrived + within


class TransportKVReceiver:
    """A decode engine's side of the transports, made in its engine process (by the maker `kv_receiver_maker`
    returns) once its KV cache exists: its own transport instance registers where prompts' KV lands (the KV
    cache in shared files, every rank's; on a GPU the receive buffers) with Mooncake or NIXL, or serves zmq's row
    socket for it (shm needs nothing but the file), so that peers' writes land there, never passing through the
    front end. `target` is how peers reach it, encoded for the front end, which sends it with every
    request.

    `check_finite`: every row peers write is a value (a model without state rows): zmq's row socket, which copies
    them in, then refuses rows holding NaN or inf, and `rows_checked` tells the engine's connector it need not
    read them again at admission. The other backends write one-sided: the engine checks."""

    def __init__(self, backend: str, host: str, secret: str | None, kv_buffers, check_finite: bool = False):
        self.transport = TRANSPORTS[backend](host, secret)
        self.transport.check_finite = check_finite  # (a transport that copies rows in checks them as it does)
        self.rows_checked = self.transport.copies_rows_in and check_finite
        self.target = msgspec.msgpack.encode(self.transport.register(kv_buffers))

    def close(self) -> None:
        self.transport.close()


def kv_receiver_maker(backend: str, host: str, secret: str | None = None) -> Callable:
    """What a decode engine process registers its KV cache with (picklable; called with the engine's KV
    buffers, and `check_finite=` whether every row peers write there is a value: see `TransportKVReceiver`)."""
    return functools.partial(TransportKVReceiver, backend, host, secret)


def decode_target(encoded: bytes) -> TransferTarget:
    return msgspec.msgpack.decode(encoded, type=TransferTarget)
