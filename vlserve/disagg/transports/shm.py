"""Shared memory on one host: the sender (encoder or prefill instance) maps the receiver's receive buffers (a file
in /dev/shm) and writes each chunk straight into the named blocks; only the header travels, over the control
connection.

The sender maps nothing but a vlserve transfer file of exactly the announced size in the shared-memory
directory, so an authenticated peer still cannot make it write anywhere else. It keeps the file open and checks
its size again right before every write: memory past the end of a truncated file is a SIGBUS, not an exception,
so a file shrunk behind our back must be refused before it is touched. (The receiver puts the size back
when it notices: `TransferBuffers.restore_file`.) Only a truncation racing a write already under way can still
fault; whoever can do that runs as this user and could kill the process anyway.
"""

from __future__ import annotations

import io
import os
import threading
from dataclasses import dataclass

import torch

from vlserve.core.errors import VlserveError
from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import Transport, write_run
from vlserve.engine.transfer_buffers import TransferBuffers

MAX_MAPPED = 64  # receivers' files that stay mapped (one per receiving server on this host, or per rank of one)


class FileResized(VlserveError, ValueError):
    """The receiver's buffer file no longer has the size of its layout: writing would fault. (Ours, with a clear
    message: the receiver logs it, no traceback.)"""


@dataclass
class _Mapped:
    buffers: TransferBuffers
    file: io.FileIO  # the very file mapped, open for fstat; closed when the last user lets go of this entry

    def write(self, block_ids: list[int], rows: torch.Tensor, first_row: int = 0, first_plane: int = 0) -> int:
        size, want = os.fstat(self.file.fileno()).st_size, self.buffers.layout.nbytes
        if size != want:
            raise FileResized(f"the receiver's buffer file {self.buffers.layout.path} now has {size} bytes, its "
                              f"layout says {want} (truncated or resized by someone else): nothing written")
        return write_run(self.buffers, block_ids, rows, first_row, first_plane)


class ShmTransport(Transport):
    name = "shm"
    maps_receiver_file = True
    writes_planes = True  # a copy straight out of a view of the rows: one rank's heads are never gathered first
    writes_layers = True

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None):
        super().__init__(host, secret)
        self._mapped: dict[str, _Mapped] = {}
        self._lock = threading.Lock()

    def target(self, buffers: TransferBuffers) -> TransferTarget:
        if not buffers.layout.path:
            raise ValueError("the shm transport needs receive buffers in a shared file")
        return TransferTarget(self.name, buffers.layout)

    def _buffers(self, target: TransferTarget) -> _Mapped:
        layout = target.layout
        for path in [p for p in self._mapped if not os.path.exists(p)]:
            del self._mapped[path]  # that server has stopped: let its memory go
        mapped = self._mapped.get(layout.path)
        if mapped is not None and mapped.buffers.layout == layout:
            return mapped
        buffers, file = TransferBuffers.open_existing(layout)
        if len(self._mapped) >= MAX_MAPPED:
            self._mapped.pop(next(iter(self._mapped)))
        mapped = self._mapped[layout.path] = _Mapped(buffers, file)
        return mapped

    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        with self._lock:  # the map of receivers is shared by the threads that write
            mapped = self._buffers(target)
        try:
            return mapped.write(block_ids, rows, first_row, first_plane)
        except FileResized:
            with self._lock:
                if self._mapped.get(target.layout.path) is mapped:
                    del self._mapped[target.layout.path]  # mapped afresh (and checked) next time
            raise
