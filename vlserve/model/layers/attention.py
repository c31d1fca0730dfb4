"""Paged attention over a flat batch of tokens: one Triton launch on CUDA; on CPU vlserve's kernels, or torch's
scaled_dot_product_attention where they cannot run.

Layout of one layer's KV cache: `[2, num_blocks * block_size, num_kv_heads, head_dim]` (K then V); a token's
slot is `block_id * block_size + offset`. The runner builds one `AttentionMetadata` per step and every layer
reuses it, so per-layer work is only the cache write, a gather and the SDPA calls.

On CUDA (`meta.varlen` set; see vlserve.model.accelerator) every sequence of the step, decode rows and prefill
chunks alike, is attended in one launch of vlserve's varlen Triton kernel, which reads K/V through the block
table where they lie (vlserve.model.kernels.triton_attention).

The CPU path: tokens of a step are ordered decode-first: the first `num_decode_tokens` tokens each belong to a different
sequence with exactly one new token. On CPU they go to vlserve's paged decode kernel, which reads K/V where they
lie in the cache (no per-layer gather of whole contexts); elsewhere (CUDA, fp16, head sizes not a multiple of 16,
no compiler) they are gathered and attended in one batched, padded SDPA call. Every other sequence
(a prefill chunk) gets its own call, causal and seeing its cached prefix: vlserve's flash-style CPU kernel, or SDPA
with a mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlserve.model.kernels import cpu_kernels, triton_kernels
from vlserve.model.layers.linear_state import LinearStateBatch


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence in the flat token batch
    num_tokens: int  # tokens computed this step
    context_slots: torch.Tensor | None  # [ctx_len] slots of prefix + this chunk; None when there is no prefix
    mask: torch.Tensor | None  # [num_tokens, ctx_len] bool, True = may attend; None when there is no prefix


@dataclass
class VarlenBatch:
    """Every sequence of a step for the varlen kernel, in batch order (decode rows first)."""

    query_start: torch.Tensor  # [B + 1] int64: sequence b's new tokens are rows query_start[b] .. query_start[b+1]
    seq_lens: torch.Tensor  # [B] int64: tokens sequence b attends over (cached prefix + new tokens)
    block_table: torch.Tensor  # [B, max_blocks] int64 block ids (padding: 0)
    max_query_len: int  # the most new tokens any sequence has (1 for a decode-only step)
    work: dict = field(default_factory=dict)  # the kernel's program work lists, built by the first layer


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0
    block_size: int = 16
    decode_blocks: torch.Tensor | None = None  # [num_decode * max_blocks] block ids to gather (padding -> 0)
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None = None  # [num_decode] int64, tokens each decode row attends to
    prefills: list[PrefillSpan] = field(default_factory=list)  # varlen path: spans without slots or mask
    linear: LinearStateBatch | None = None  # hybrid models: each sequence's linear-attention state slot
    varlen: VarlenBatch | None = None  # set: the Triton path (then the decode/prefill fields above are unused)
    # Called with k after the k-th layer with a KV cache has run (its keys and values are in the cache): a prefill
    # engine starts sending that layer's KV while the next ones compute (engine.kv_connector.layer_sends).
    after_kv_layer: Callable[[int], None] | None = None


def build_prefill_span(start: int, num_tokens: int, context_len: int, slots: torch.Tensor | None) -> PrefillSpan:
    """`context_len` counts the cached prefix plus this chunk; `slots` holds all of their slots."""
    if context_len == num_tokens:
        return PrefillSpan(start, num_tokens, None, None)
    prefix = context_len - num_tokens
    q_pos = torch.arange(num_tokens, device=slots.device).unsqueeze(1) + prefix
    k_pos = torch.arange(context_len, device=slots.device).unsqueeze(0)
    return PrefillSpan(start, num_tokens, slots, k_pos <= q_pos)


def _decode_kernels(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
    """The compiled CPU kernels when they can take this step's decode rows, else None."""
    if q.shape[-1] % 16 or meta.decode_context_lens is None:
        return None
    return cpu_kernels.for_tensor(kv_cache)


def _prefill_kernels(q: torch.Tensor, k: torch.Tensor):
    """The compiled CPU kernels for prefill chunks: 3.5-5.7x torch's CPU flash attention at a few hundred tokens
    (bf16 or fp32), whose inner products are small GEMM calls. Head sizes that no vector width divides, and more
    than 64 query heads per key/value head (one unit of the kernel), keep SDPA."""
    if q.shape[-1] % 8 or q.shape[1] // k.shape[1] > 64:
        return None
    return cpu_kernels.for_tensor(q)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.varlen is not None:
        vb = meta.varlen
        out = q.new_empty(num_tokens, num_heads, head_dim)
        triton_kernels().varlen_attention(q, k_cache, v_cache, vb.query_start, vb.max_query_len, scale, True,
                                          vb.seq_lens, vb.block_table, meta.block_size, out=out, work_cache=vb.work)
        return out.view(num_tokens, num_heads * head_dim)

    nd = meta.num_decode_tokens
    kernels = _decode_kernels(q, kv_cache, meta) if nd else None
    if kernels is not None:
        od = kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_blocks.view(nd, -1),
                                            meta.decode_context_lens, meta.block_size, scale, cpu_kernels.isa_cap())
        if nd == num_tokens:  # a decode-only step: the kernel's output is the whole answer (no copy)
            return od.view(num_tokens, num_heads * head_dim)
    out = torch.empty_like(q)
    if kernels is not None:
        out[:nd] = od
    elif nd:
        # GQA without repeating K/V: the query heads sharing a KV head become that head's "query rows".
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        # Whole blocks via index_select: contiguous copies, ~10x faster than per-slot advanced indexing.
        shape = (nd, -1, num_kv_heads, head_dim)
        blocks = (-1, meta.block_size, num_kv_heads, head_dim)
        kd = k_cache.view(blocks).index_select(0, meta.decode_blocks).view(shape).transpose(1, 2)
        vd = v_cache.view(blocks).index_select(0, meta.decode_blocks).view(shape).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    prefill_kernels = _prefill_kernels(q, k) if meta.prefills else None
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.context_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_cache.index_select(0, span.context_slots), v_cache.index_select(0, span.context_slots)
        if prefill_kernels is not None:
            out[rows] = prefill_kernels.prefill_attention(q[rows], ks, vs, True, scale, cpu_kernels.isa_cap())
            continue
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        os_ = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=group > 1
        )
        out[rows] = os_.squeeze(0).transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
