"""One LM forward pass as plain tensors: what the model runner decided for a step, in a form every
tensor-parallel rank can run from (and that travels to them as a typed message).

The runner on rank 0 builds it from the scheduled chunks (token ids, M-RoPE positions, KV slots, block tables,
the media embedding rows gathered from wherever they are); each rank turns it into its own attention metadata
(`attention_metadata`) and runs the same forward.

A hybrid model (linear-attention layers) adds each sequence's state slot, whether it starts from a zero state,
the snapshots its prefill chunk takes, and the slot copies to make before the forward (None for other models).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from vlserve.core.wire import TensorRef, tensor_from, tensor_ref
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span
from vlserve.model.layers.linear_state import LinearStateBatch


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
    # Hybrid models only, in batch order (decode rows, then prefill chunks):
    state_slots: torch.Tensor | None = None  # [num_seqs] int64 running state slot of each sequence
    state_fresh: torch.Tensor | None = None  # [num_seqs] bool: its chunk starts at token 0 (a zero state)
    state_checkpoints: list[list[tuple[int, int]]] | None = None  # per prefill chunk: (tokens in, snapshot slot)
    state_copies: list[tuple[int, int]] | None = None  # (src, dst) slot copies made before the forward pass


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
    if batch.state_slots is not None:
        meta.linear = LinearStateBatch(put(batch.state_slots), put(batch.state_fresh),
                                       batch.state_checkpoints or [[] for _ in batch.prefills])
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
    state_slots: TensorRef | None = None
    state_fresh: TensorRef | None = None
    state_checkpoints: list[list[tuple[int, int]]] | None = None
    state_copies: list[tuple[int, int]] | None = None


_TENSOR_FIELDS = ("token_ids", "positions", "slot_mapping", "decode_table", "decode_context_lens", "media_rows",
                  "media", "sample_rows", "state_slots", "state_fresh")


def batch_to_wire(batch: ForwardBatch, tensors: list[torch.Tensor]) -> WireForwardBatch:
    def ref(t):
        return None if t is None else tensor_ref(t, tensors)

    fields = {name: ref(getattr(batch, name)) for name in _TENSOR_FIELDS}
    if batch.state_fresh is not None:  # the wire carries no bool tensors
        fields["state_fresh"] = ref(batch.state_fresh.to(torch.uint8))
    return WireForwardBatch(num_decode=batch.num_decode, prefills=batch.prefills,
                            prefill_slots=[ref(s) for s in batch.prefill_slots],
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
                        prefill_slots=[tensor(s) for s in msg.prefill_slots], state_checkpoints=checkpoints,
                        state_copies=copies, **fields)
