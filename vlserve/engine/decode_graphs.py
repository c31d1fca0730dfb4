"""Decode steps replayed from graphs captured per batch size (CUDA graphs; on a CPU the same path, replayed
eagerly, which is how the bookkeeping here is tested).

A decode-only step of b sequences runs the graph of the smallest captured size >= b. Its inputs are copied into
static device buffers from pinned host staging, without blocking, in two copies whatever the model: every
per-row input (token ids, slots, lengths, positions, a hybrid model's state slots) lives in one packed buffer on
each side (`PackedInputs`), the block table in its own; the rows past b are padding: token 0 at
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
        rows = model.cfg.position_rows  # the model's position rows (M-RoPE: 3)
        self.hybrid = scratch_state_slot is not None
        fields = {"ids": ((n,), torch.long), "positions": ((rows, n), torch.long), "slots": ((n,), torch.long),
                  "lens": ((n,), torch.long)}
        if self.hybrid:
            fields |= {"state": ((n,), torch.long), "fresh": ((n,), torch.bool)}
        self.inputs = PackedInputs(fields, accelerator)
        dev_in, self.stage = self.inputs.device, self.inputs.host
        self.token_ids, self.positions, self.seq_lens = dev_in["ids"], dev_in["positions"], dev_in["lens"]
        self.slot_mapping = dev_in["slots"].fill_(scratch_block * block_size)
        self.seq_lens.fill_(1)
        if self.hybrid:
            self.state_slots = dev_in["state"].fill_(scratch_state_slot)
            self.state_fresh = dev_in["fresh"].fill_(True)
        self.inputs.host_bytes.copy_(self.inputs.device_bytes)  # rows no step fills keep these (padding) values
        self.block_table = torch.full((n, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=dev)  # one query token per row
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.stage_table = accelerator.staging((n, max_blocks), torch.long)
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
        stage = self.stage
        stage["ids"][:b] = batch.token_ids
        stage["ids"][b:size] = 0
        stage["positions"][:, :b] = batch.positions
        stage["positions"][:, b:size] = 0
        stage["slots"][:b] = batch.slot_mapping
        stage["slots"][b:size] = self.scratch_block * bs
        stage["lens"][:b] = batch.context_lens
        stage["lens"][b:size] = 1
        if self.hybrid:
            stage["state"][:b] = batch.state_slots
            stage["state"][b:size] = self.scratch_state_slot
            stage["fresh"][:b] = batch.state_fresh
            stage["fresh"][b:size] = True
        self.inputs.upload()  # every per-row input in one copy (rows past `size` are never read)
        self.stage_table[:b, :width] = batch.block_table
        self.stage_table[b:size, 0] = self.scratch_block
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


class PackedInputs:
    """Named tensors laid out one after another (each 8-byte aligned) in one host staging buffer and one device
    buffer of the same layout: filling the host views and calling `upload` moves them all in one copy, where a
    copy per tensor cost a host-to-device call each (#70 item 1)."""

    ALIGN = 8

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], accelerator: Accelerator):
        self.acc, spans, offset = accelerator, {}, 0
        for name, (shape, dtype) in fields.items():
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            spans[name] = (offset, nbytes, shape, dtype)
            offset += -(-nbytes // self.ALIGN) * self.ALIGN
        self.host_bytes = accelerator.staging((offset,), torch.uint8)
        self.device_bytes = torch.zeros(offset, dtype=torch.uint8, device=accelerator.device)
        self.host = {name: self._view(self.host_bytes, *span) for name, span in spans.items()}
        self.device = {name: self._view(self.device_bytes, *span) for name, span in spans.items()}

    @staticmethod
    def _view(buffer: torch.Tensor, offset: int, nbytes: int, shape, dtype) -> torch.Tensor:
        return buffer[offset : offset + nbytes].view(dtype).view(shape)

    def upload(self) -> None:
        self.device_bytes.copy_(self.host_bytes, non_blocking=self.acc.is_cuda)


def _ranges(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
