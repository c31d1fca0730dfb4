"""Decode steps replayed from graphs captured per batch size (CUDA graphs; on a CPU the same path, replayed
eagerly, which is how the bookkeeping here is tested).

A decode-only step of b sequences runs the graph of the smallest captured size >= b. Its inputs are copied into
static device buffers (from pinned host staging, without blocking); the rows past b are padding: token 0 at
position 0 writing its K/V into a scratch block no request owns and attending to that slot alone, and, for a
hybrid model, reading and writing a scratch state slot. Their hidden states are dropped. The replay then computes
exactly what an eager pass over the b real rows computes.

What a graph cannot hold stays eager: prefill chunks, media rows, state copies, and batches larger than the
largest size.
"""

from __future__ import annotations

import logging
import time

import torch

from vlserve.engine.forward_batch import ForwardBatch
from vlserve.model.accelerator import NATIVE, Accelerator, to_device
from vlserve.model.layers.attention import AttentionMetadata, VarlenBatch
from vlserve.model.layers.linear_state import LinearStateBatch
from vlserve.model.layers.static_shapes import static_shapes

logger = logging.getLogger("vlserve.engine")
MAX_DEFAULT_SIZE = 256


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to min(max_num_seqs, 256) (itself included)."""
    top = min(max_num_seqs, MAX_DEFAULT_SIZE)
    sizes = {n for n in (1, 2, 4, 8) if n <= top} | set(range(16, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def padded_size(sizes: tuple[int, ...], batch: int) -> int | None:
    """The smallest captured size that holds `batch` rows, None when none does."""
    return next((s for s in sizes if s >= batch), None)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, accelerator: Accelerator, sizes: tuple[int, ...],
                 block_size: int, max_blocks: int, scratch_block: int, scratch_state_slot: int | None):
        """`sizes`: batch sizes to capture. `max_blocks`: block-table width (blocks of the longest context).
        `scratch_block`: a KV block no request owns (padding rows write there); `scratch_state_slot`: a hybrid
        model's state slot no sequence owns (None for other models)."""
        self.model, self.kv_caches, self.acc = model, kv_caches, accelerator
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = block_size
        self.scratch_block, self.scratch_state_slot = scratch_block, scratch_state_slot
        n, dev = self.sizes[-1], accelerator.device
        hidden = model.cfg.text.hidden_size
        dtype = model.language_model.embed_tokens.weight.dtype
        self.token_ids = torch.zeros(n, dtype=torch.long, device=dev)
        rows = model.cfg.position_rows  # the model's position rows (M-RoPE: 3)
        self.positions = torch.zeros(rows, n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.block_table = torch.full((n, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=dev)  # one query token per row
        self.hybrid = scratch_state_slot is not None
        if self.hybrid:
            self.state_slots = torch.full((n,), scratch_state_slot, dtype=torch.long, device=dev)
            self.state_fresh = torch.ones(n, dtype=torch.bool, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        # host staging: one pinned buffer per input, filled for each step and copied in one go
        self.stage_ids = accelerator.staging((n,), torch.long)
        self.stage_pos = accelerator.staging((rows, n), torch.long)
        self.stage_slots = accelerator.staging((n,), torch.long)
        self.stage_lens = accelerator.staging((n,), torch.long)
        self.stage_table = accelerator.staging((n, max_blocks), torch.long)
        if self.hybrid:
            self.stage_state = accelerator.staging((n,), torch.long)
            self.stage_fresh = accelerator.staging((n,), torch.bool)
        self.staged = accelerator.event()  # after the last step's copies out of the staging buffers
        self.graphs: dict[int, object] = {}
        self.replays: dict[int, int] = {}  # size -> steps it ran (tests and logs read it)

    def capture(self) -> None:
        """Every size, largest first (later graphs reuse the first one's memory pool)."""
        t0 = time.perf_counter()
        with torch.inference_mode():  # as the steps that replay them run
            for size in reversed(self.sizes):
                self.graphs[size] = self.acc.capture(lambda size=size: self._forward(size))
        self.acc.synchronize()
        logger.info("decode graphs: %d sizes (%s) in %.1fs", len(self.sizes), _ranges(self.sizes),
                    time.perf_counter() - t0)

    def fits(self, batch: ForwardBatch) -> bool:
        """A decode-only step without media or state copies, no larger than the largest size."""
        return (not batch.prefills and batch.media is None and not batch.state_copies and batch.num_decode > 0
                and batch.num_decode <= self.sizes[-1] and batch.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [b, hidden] of the step's b decode rows."""
        b = batch.num_decode
        size = padded_size(self.sizes, b)
        self._stage(batch, b, size)
        self.graphs[size].replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        return self.hidden[:b]

    # ---- inside -------------------------------------------------------------------------------------------------
    def _stage(self, batch: ForwardBatch, b: int, size: int) -> None:
        """The real rows, then padding rows, into the staging buffers, then onto the device. The copies run
        without blocking, so the host first waits until the last step's copies have read the buffers (a step
        that samples nothing, such as a one-token prompt chunk, leaves them possibly unread)."""
        self.staged.synchronize()
        bs = self.block_size
        width = batch.block_table.shape[1]
        self.stage_ids[:b] = batch.token_ids
        self.stage_ids[b:size] = 0
        self.stage_pos[:, :b] = batch.positions
        self.stage_pos[:, b:size] = 0
        self.stage_slots[:b] = batch.slot_mapping
        self.stage_slots[b:size] = self.scratch_block * bs
        self.stage_lens[:b] = batch.context_lens
        self.stage_lens[b:size] = 1
        self.stage_table[:b, :width] = batch.block_table
        self.stage_table[b:size, 0] = self.scratch_block
        copies = [(self.stage_ids, self.token_ids), (self.stage_slots, self.slot_mapping),
                  (self.stage_lens, self.seq_lens)]
        if self.hybrid:
            self.stage_state[:b] = batch.state_slots
            self.stage_state[b:size] = self.scratch_state_slot
            self.stage_fresh[:b] = batch.state_fresh
            self.stage_fresh[b:size] = True
            copies += [(self.stage_state, self.state_slots), (self.stage_fresh, self.state_fresh)]
        for host, static in copies:
            static[:size].copy_(host[:size], non_blocking=self.acc.is_cuda)
        self.positions[:, :size].copy_(self.stage_pos[:, :size], non_blocking=self.acc.is_cuda)
        # Only the columns the step uses: beyond them a row keeps older block ids, which it never reads (it
        # reads the blocks its length spans), and every one of them is a valid block.
        self.block_table[:size, :width].copy_(self.stage_table[:size, :width], non_blocking=self.acc.is_cuda)
        self.staged.record()
        if batch.pending_rows is not None:  # input tokens the previous step is still sampling, on the device
            self.token_ids[to_device(batch.pending_rows, self.token_ids.device)] = batch.pending_tokens

    def _metadata(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                 block_size=self.block_size)
        if self.acc.attention == NATIVE:  # the CPU path's decode fields, derived on the device from the buffers
            table, lens = self.block_table[:size], self.seq_lens[:size]
            pos = torch.arange(table.shape[1] * self.block_size, device=lens.device)
            meta.decode_blocks = table.reshape(-1)
            meta.decode_mask = (pos.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            meta.decode_context_lens = lens
        else:
            meta.varlen = VarlenBatch(self.query_start[: size + 1], self.seq_lens[:size], self.block_table[:size], 1)
        if self.hybrid:
            meta.linear = LinearStateBatch(self.state_slots[:size], self.state_fresh[:size], [])
        return meta

    def _forward(self, size: int) -> None:
        with static_shapes():
            meta = self._metadata(size)
            embeds = self.model.embed_tokens(self.token_ids[:size])
            self.hidden[:size] = self.model(embeds, self.positions[:, :size], self.kv_caches, meta)


def _ranges(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
