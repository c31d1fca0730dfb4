"""One LM forward pass as plain tensors: what the model runner decided for a step, in a form every
tensor-parallel rank can run from (and that travels to them as a typed message).

The runner on rank 0 builds it from the scheduled chunks (token ids, M-RoPE positions, KV slots, block tables,
the media embedding rows gathered from wherever they are); each rank turns it into its own attention metadata
(`attention_metadata`) and runs the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from vlserve.core.wire import TensorRef, tensor_from, tensor_ref
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64, decode rows first, then prefill chunks
    positions: torch.Tensor  # [3, T] M-RoPE positions
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    num_decode: int
    decode_table: torch.Tensor | None  # [num_decode, max_blocks] block ids (padding: 0)
    decode_context_lens: torch.Tensor | None  # [num_decode] tokens each decode row attends to
    prefills: list[tuple[int, int, int]]  # (first row, tokens this step, context length incl. cached prefix)
    prefill_slots: list[torch.Tensor | None]  # context slots of a chunk with a cached prefix, else None
    media_rows: torch.Tensor | None  # [R] rows whose embedding comes from a media item
    media: torch.Tensor | None  # [R, embedding_width] those rows (DeepStack features after the first hidden cols)
    sample_rows: torch.Tensor  # [S] rows whose logits are wanted (may be empty)


def attention_metadata(batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(slot_mapping=put(batch.slot_mapping), num_decode_tokens=batch.num_decode,
                             block_size=block_size)
    if batch.num_decode:
        table, ctx = batch.decode_table, batch.decode_context_lens
        pos = torch.arange(table.shape[1] * block_size)
        meta.decode_blocks = put(table.reshape(-1))
        meta.decode_mask = put((pos.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :])
        meta.decode_context_lens = put(ctx)
    for (start, num_tokens, context_len), slots in zip(batch.prefills, batch.prefill_slots):
        span = build_prefill_span(start, num_tokens, context_len, slots)
        if span.context_slots is not None:
            span.context_slots, span.mask = put(span.context_slots), put(span.mask)
        meta.prefills.append(span)
    return meta


# ---- on the wire (rank 0 -> the other ranks) ------------------------------------------------------------------
class WireForwardBatch(msgspec.Struct, array_like=True):
    token_ids: TensorRef
    positions: TensorRef
    slot_mapping: TensorRef
    num_decode: int
    decode_table: TensorRef | None
    decode_context_lens: TensorRef | None
    prefills: list[tuple[int, int, int]]
    prefill_slots: list[TensorRef | None]
    media_rows: TensorRef | None
    media: TensorRef | None
    sample_rows: TensorRef


_TENSOR_FIELDS = ("token_ids", "positions", "slot_mapping", "decode_table", "decode_context_lens", "media_rows",
                  "media", "sample_rows")


def batch_to_wire(batch: ForwardBatch, tensors: list[torch.Tensor]) -> WireForwardBatch:
    def ref(t):
        return None if t is None else tensor_ref(t, tensors)

    fields = {name: ref(getattr(batch, name)) for name in _TENSOR_FIELDS}
    return WireForwardBatch(num_decode=batch.num_decode, prefills=batch.prefills,
                            prefill_slots=[ref(s) for s in batch.prefill_slots], **fields)


def batch_from_wire(msg: WireForwardBatch, frames: list) -> ForwardBatch:
    def tensor(ref):
        return None if ref is None else tensor_from(ref, frames)

    fields = {name: tensor(getattr(msg, name)) for name in _TENSOR_FIELDS}
    return ForwardBatch(num_decode=msg.num_decode, prefills=[tuple(p) for p in msg.prefills],
                        prefill_slots=[tensor(s) for s in msg.prefill_slots], **fields)
