"""What transports that write the receiver's memory themselves share (Mooncake, NIXL): a registered staging
buffer the chunk's rows are packed into, and the list of (source, destination, length) writes that puts them
into the receiver's blocks, one write per run of consecutive slots."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import check_run
from vlserve.engine.transfer_buffers import DTYPES, slot_runs

STAGING_BYTES = 64 * 2**20  # registered once; a bigger chunk gets a bigger staging buffer


class StagedWrites:
    """Packs chunks into a registered staging buffer and plans their writes; one chunk at a time."""

    def __init__(self, register: Callable[[torch.Tensor], None], unregister: Callable[[torch.Tensor], None]):
        self._register = register  # makes a host buffer usable as a write source for the engine
        self._unregister = unregister
        self._staging: torch.Tensor | None = None
        self.lock = threading.Lock()  # hold it from `plan` until the writes are done

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self._unregister(self._staging)
            self._staging = torch.empty(max(nbytes, STAGING_BYTES), dtype=torch.uint8)
            self._register(self._staging)
        return self._staging

    def plan(self, block_ids: list[int], rows: torch.Tensor, target: TransferTarget, first_row: int = 0,
             first_plane: int = 0) -> tuple[list[int], list[int], list[int]]:
        """(source addresses, destination addresses, lengths) that put `rows` (whole, or planes first_plane..)
        into the run `block_ids` of the receiver's buffers at `target.base_address`, from the run's row
        `first_row`."""
        layout = target.layout
        check_run(layout, block_ids, rows, first_row, first_plane)
        count = rows.shape[0]
        if not count:
            return [], [], []
        planes = layout.parts if rows.dim() == 2 else rows.shape[1]
        # Staged plane by plane ([planes, m, part width]): each run of slots is then one contiguous source too.
        pieces = rows.to(DTYPES[layout.dtype]).reshape(count, planes, -1).transpose(0, 1).contiguous()
        flat = pieces.view(torch.uint8).view(planes, count, -1)
        piece_bytes = flat.shape[2]
        staging = self._staging_for(flat.numel())
        staging[: flat.numel()].view(planes, count, piece_bytes).copy_(flat)
        index = torch.arange(first_row, first_row + count)
        table = torch.tensor(block_ids, dtype=torch.int64)
        slots = table[index // layout.block_tokens] * layout.block_tokens + index % layout.block_tokens
        base = target.base_address + layout.offsets()["rows"]
        plane_slots = layout.num_blocks * layout.block_tokens
        src, dst, lengths = [], [], []
        for first, slot, n in slot_runs(slots):
            for part in range(planes):
                src.append(staging.data_ptr() + (part * count + first) * piece_bytes)
                dst.append(base + ((first_plane + part) * plane_slots + slot) * piece_bytes)
                lengths.append(n * piece_bytes)
        return src, dst, lengths
