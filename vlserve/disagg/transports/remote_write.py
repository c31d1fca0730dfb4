"""What transports that write the receiver's memory themselves share (Mooncake, NIXL): a registered staging
buffer the chunk is packed into, and the list of (source, destination, length) writes that puts it into the
receiver's blocks, one write per run of consecutive slots of each array."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vlserve.disagg.messages import TransferChunk, TransferTarget
from vlserve.disagg.transports.base import ChunkData, chunk_row_tokens
from vlserve.engine.transfer_buffers import DTYPES

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

    def plan(self, header: TransferChunk, data: ChunkData,
             target: TransferTarget) -> tuple[list[int], list[int], list[int]]:
        """(source addresses, destination addresses, lengths) that put `data` into `header.block_ids` of the
        receiver's buffers at `target.base_address`."""
        layout, offsets = target.layout, target.layout.offsets()
        rows = data.rows.to(DTYPES[layout.dtype]).contiguous()
        arrays = [("fill_ids", data.fill_ids.to(torch.int64).contiguous(), torch.arange(header.num_tokens)),
                  ("positions", data.positions.to(torch.int64).contiguous(), torch.arange(header.num_tokens)),
                  ("embeddings", rows, chunk_row_tokens(header))]
        if not header.block_ids or any(not 0 <= b < layout.num_blocks for b in header.block_ids):
            raise ValueError(f"block ids outside the receiver's {layout.num_blocks} blocks")
        table = torch.tensor(header.block_ids, dtype=torch.int64)
        span = len(header.block_ids) * layout.block_tokens
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
            for (index, slot), count in runs(slots):
                src.append(staging.data_ptr() + at + index * row_bytes)
                dst.append(base + slot * row_bytes)
                lengths.append(count * row_bytes)
            at += flat.numel()
        return src, dst, lengths


def runs(slots: torch.Tensor):
    """((index in the chunk, first slot), length) of each run of consecutive slots."""
    values = slots.tolist()
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            yield (start, values[start]), i - start
            start = i
