"""The Mooncake transfer engine (TCP here, RDMA where the hardware has it): the receiver registers its
receive buffers once; the sender writes each chunk into the named blocks with one batch of remote writes, then
sends the header alone over the control connection.

Metadata goes through Mooncake's own peer-to-peer handshake (no etcd, no metadata server): a receiver is
addressed by the "host:port" of its transfer engine, which travels in the request's `TransferTarget`.
"""

from __future__ import annotations

import torch

from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import Transport
from vlserve.disagg.transports.remote_write import StagedWrites
from vlserve.engine.transfer_buffers import TransferBuffers

PROTOCOL = "tcp"  # "rdma" needs RDMA NICs; the engine is the same


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
    writes_planes = True  # (staged plane by plane: a rank's heads go into the staging buffer as they are)
    writes_layers = True

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None):
        super().__init__(host, secret)
        self.engine = mooncake_engine_class()()
        if self.engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise RuntimeError(f"the Mooncake transfer engine could not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []  # kept alive while registered
        self.staged = StagedWrites(self._register, self._unregister)

    def _register(self, region: torch.Tensor) -> None:
        if self.engine.register_memory(region.data_ptr(), region.numel()) != 0:
            raise RuntimeError("the Mooncake transfer engine could not register memory")
        self._registered.append(region)

    def _unregister(self, region: torch.Tensor) -> None:
        self.engine.unregister_memory(region.data_ptr())
        self._registered = [r for r in self._registered if r is not region]

    # ---- receiver --------------------------------------------------------------------------------------------
    def target(self, buffers: TransferBuffers) -> TransferTarget:
        self._register(buffers.storage)
        return TransferTarget(self.name, buffers.layout, self.session, buffers.storage.data_ptr())

    # ---- sender ----------------------------------------------------------------------------------------------
    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        with self.staged.lock:
            src, dst, lengths = self.staged.plan(block_ids, rows, target, first_row, first_plane)
            if not lengths:
                return 0
            if self.engine.batch_transfer_sync_write(target.session, src, dst, lengths) != 0:
                raise RuntimeError(f"the Mooncake write to {target.session} failed")
            return sum(lengths)

    def close(self) -> None:
        for region in self._registered:
            self.engine.unregister_memory(region.data_ptr())
        self._registered.clear()
