"""One LM forward pass as plain tensors: what the model runner decided for a step, in a form every
tensor-parallel rank can run from (and that travels to them as a typed message).

The runner on rank 0 builds it from the scheduled chunks (token ids, positions, KV slots, block tables,
the media embedding rows gathered from wherever they are); each rank turns it into its own attention metadata
(`attention_metadata`: the varlen kernel's on CUDA, the CPU path's per-sequence spans otherwise) and runs the same
forward.

A hybrid model (linear-attention layers) adds each sequence's state slot, whether it starts from a zero state,
the snapshots its prefill chunk takes, and the slot copies to make before the forward (None for other models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from vlserve.core.wire import TensorRef, tensor_from, tensor_ref
from vlserve.model.accelerator import NATIVE, TRITON, to_device
from vlserve.model.layers.attention import AttentionMetadata, PrefillSpan, VarlenBatch, build_prefill_span
from vlserve.model.layers.linear_state import LinearStateBatch


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64, decode rows first, then prefill chunks
    positions: torch.Tensor  # [k, T] positions (k: the model's position rows)
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    num_decode: int
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64 block ids of every sequence (padding: 0)
    context_lens: torch.Tensor  # [num_seqs] int64 tokens each sequence attends over (cached + this step's)
    prefills: list[tuple[int, int, int]]  # (first row, tokens this step, context length incl. cached prefix)
    media_rows: torch.Tensor | None  # [R] rows whose embedding comes from a media item
    media: torch.Tensor | None  # [R, embedding_width] those rows (DeepStack features after the first hidden cols)
    sample_rows: torch.Tensor  # [S] rows whose logits are wanted (may be empty)
    # Hybrid models only, in batch order (decode rows, then prefill chunks):
    state_slots: torch.Tensor | None = None  # [num_seqs] int64 running state slot of each sequence
    state_fresh: torch.Tensor | None = None  # [num_seqs] bool: its chunk starts at token 0 (a zero state)
    state_checkpoints: list[list[tuple[int, int]]] | None = None  # per prefill chunk: (tokens in, snapshot slot)
    state_copies: list[tuple[int, int]] | None = None  # (src, dst) slot copies made before the forward pass
    # Async scheduling: rows whose input token the previous step is still sampling, and those tokens, on the
    # device (one process only: never on the wire).
    pending_rows: torch.Tensor | None = None  # [P] int64 rows of token_ids
    pending_tokens: torch.Tensor | None = None  # [P] int64, on the model's device
    # LoRA: (adapter slot, rows) groups of vlserve.model.layers.lora_rows (not on the wire: tensor-parallel ranks
    # get them, with the slots' adapters, in the step's message)
    lora_rows: tuple = ()
    # Called after each layer with a KV cache (AttentionMetadata.after_kv_layer; rank 0's own, never on the wire)
    after_kv_layer: Callable[[int], None] | None = None


def attention_metadata(batch: ForwardBatch, block_size: int, device: torch.device,
                       backend: str = NATIVE) -> AttentionMetadata:
    def put(t: torch.Tensor) -> torch.Tensor:
        return to_device(t, device)

    meta = AttentionMetadata(slot_mapping=put(batch.slot_mapping), num_decode_tokens=batch.num_decode,
                             block_size=block_size, after_kv_layer=batch.after_kv_layer)
    if backend == TRITON:
        lens = [1] * batch.num_decode + [n for _, n, _ in batch.prefills]
        query_start = torch.tensor([0] + lens).cumsum(0)
        meta.varlen = VarlenBatch(put(query_start), put(batch.context_lens), put(batch.block_table), max(lens))
        # where each prefill chunk's rows are (linear-attention layers run them one sequence at a time)
        meta.prefills = [PrefillSpan(start, num_tokens, None, None) for start, num_tokens, _ in batch.prefills]
    else:
        _native_spans(meta, batch, block_size, put)
    if batch.state_slots is not None:
        meta.linear = LinearStateBatch(put(batch.state_slots), put(batch.state_fresh),
                                       batch.state_checkpoints or [[] for _ in batch.prefills])
    return meta


def _native_spans(meta: AttentionMetadata, batch: ForwardBatch, block_size: int, put) -> None:
    """The CPU path's view: the decode rows' block table and mask, and each prefill chunk's context slots."""
    nd = batch.num_decode
    if nd:
        ctx = batch.context_lens[:nd]
        table = batch.block_table[:nd, : -(-int(ctx.max()) // block_size)]
        pos = torch.arange(table.shape[1] * block_size)
        meta.decode_blocks = put(table.reshape(-1))
        meta.decode_mask = put((pos.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :])
        meta.decode_context_lens = put(ctx)
    for j, (start, num_tokens, context_len) in enumerate(batch.prefills):
        slots = None
        if context_len > num_tokens:  # a cached prefix: the chunk attends over slots from the block table
            idx = torch.arange(context_len)
            slots = batch.block_table[nd + j][idx // block_size] * block_size + idx % block_size
        span = build_prefill_span(start, num_tokens, context_len, slots)
        if span.context_slots is not None:
            span.context_slots, span.mask = put(span.context_slots), put(span.mask)
        meta.prefills.append(span)


# ---- on the wire (rank 0 -> the other ranks) ------------------------------------------------------------------
class WireForwardBatch(msgspec.Struct, array_like=True):
    token_ids: TensorRef
    positions: TensorRef
    slot_mapping: TensorRef
    num_decode: int
    block_table: TensorRef
    context_lens: TensorRef
    prefills: list[tuple[int, int, int]]
    media_rows: TensorRef | None
    media: TensorRef | None
    sample_rows: TensorRef
    state_slots: TensorRef | None = None
    state_fresh: TensorRef | None = None
    state_checkpoints: list[list[tuple[int, int]]] | None = None
    state_copies: list[tuple[int, int]] | None = None


_TENSOR_FIELDS = ("token_ids", "positions", "slot_mapping", "block_table", "context_lens", "media_rows",
                  "media", "sample_rows", "state_slots", "state_fresh")


def batch_to_wire(batch: ForwardBatch, tensors: list[torch.Tensor]) -> WireForwardBatch:
    if batch.pending_rows is not None:
        raise ValueError("a batch whose input tokens are still on rank 0's device cannot go to other ranks")
    def ref(t):
        return None if t is None else tensor_ref(t, tensors)

    fields = {name: ref(getattr(batch, name)) for name in _TENSOR_FIELDS}
    if batch.state_fresh is not None:  # the wire carries no bool tensors
        fields["state_fresh"] = ref(batch.state_fresh.to(torch.uint8))
    return WireForwardBatch(num_decode=batch.num_decode, prefills=batch.prefills,
                            state_checkpoints=batch.state_checkpoints, state_copies=batch.state_copies, **fields)


def batch_from_wire(msg: WireForwardBatch, frames: list) -> ForwardBatch:
    def tensor(ref):
        return None if ref is None else tensor_from(ref, frames)

    fields = {name: tensor(getattr(msg, name)) for name in _TENSOR_FIELDS}
    if fields["state_fresh"] is not None:
        fields["state_fresh"] = fields["state_fresh"].bool()
    checkpoints = None if msg.state_checkpoints is None else [[tuple(c) for c in span]
                                                              for span in msg.state_checkpoints]
    copies = None if msg.state_copies is None else [tuple(c) for c in msg.state_copies]
    return ForwardBatch(num_decode=msg.num_decode, prefills=[tuple(p) for p in msg.prefills],
                        state_checkpoints=checkpoints,
                        state_copies=copies, **fields)
