"""Varlen attention as one Triton kernel launch: the CUDA path of the LM's paged attention and of the vision towers.

One launch covers a whole flat batch, never a Python loop over sequences:
- the LM (`paged=True`): every sequence of a step (decode rows with one query token, prefill chunks with many)
  reads its keys and values from the paged KV cache through its block-table row; query token i of a sequence
  of `q_len` new tokens and `seq_len` tokens in all sits at position `seq_len - q_len + i` and sees keys up to
  it (causal). The step's new K/V are written to the cache before the launch.
- the vision towers (`paged=False`): keys and values are the query's own rows, `cu_seqlens` marks where each
  sequence (picture, frame or window) starts, attention is full inside a sequence and never across.

The program grid is (sequence, block of query tokens, key/value head). A program's tile rows are
(query token, query head of its group) pairs, so grouped-query heads share each K/V load (a decode row's whole
group fills one tile). Scores and the online softmax are fp32; fp32 inputs multiply in IEEE fp32 (no TF32),
so fp32 parity with the reference stays token-exact.

Where CUDA is absent (CI, the developers' CPUs) the kernel is defined in Triton's interpreter, which runs the
same program on the CPU with numpy: slow, and only for tests of this kernel's logic.
"""

from __future__ import annotations

import torch

from vlserve.model.kernels.triton_runtime import available, tl, triton

BLOCK_ROWS_PREFILL = 64  # tile rows (query tokens x grouped heads) of a prefill program
BLOCK_KEYS = 32  # keys per inner step


if triton is not None:

    @triton.jit
    def _varlen_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        query_start_ptr, seq_lens_ptr, block_table_ptr, work_seq_ptr, work_block_ptr, num_seqs,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_table, block_size, scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        work = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(work_seq_ptr + work)
        if seq >= num_seqs:  # a spare program of a grid sized for the most work the batch could have
            return
        q_block = tl.load(work_block_ptr + work)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        first = q_block * BLOCK_Q  # this program's first query token within the sequence
        if first >= q_len:
            return
        if PAGED:
            kv_len = tl.load(seq_lens_ptr + seq)
        else:
            kv_len = q_len
        prefix = kv_len - q_len  # keys before the first new token

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        token = first + rows // GROUP_PAD  # query token within the sequence
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM

        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if CAUSAL:
            last_token = tl.minimum(first + BLOCK_Q, q_len) - 1
            key_end = prefix + last_token + 1
        else:
            key_end = kv_len
        query_pos = prefix + token  # causal: a row sees keys at positions <= its own

        for key_start in range(0, key_end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_ok = keys < key_end
            if PAGED:
                block = tl.load(block_table_ptr + seq * stride_table + keys // block_size, mask=key_ok, other=0)
                key_rows = block.to(tl.int64) * block_size + keys % block_size
            else:
                key_rows = (q_start + keys).to(tl.int64)
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + key_rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            visible = key_ok[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= query_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet (padding rows)
            p = tl.exp(s - m_safe[:, None])
            correction = tl.exp(m - m_safe)
            denom = denom * correction + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def varlen_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # paged: [slots, kv_heads, head_dim] (the cache); else [T, kv_heads, head_dim]
    v: torch.Tensor,
    query_start: torch.Tensor,  # [B + 1] int32: sequence b's query rows are query_start[b] .. query_start[b+1]
    max_query_len: int,  # an upper bound of the sequences' query lengths (sizes the grid)
    scale: float,
    causal: bool,
    seq_lens: torch.Tensor | None = None,  # paged: [B] int32, tokens each sequence attends over (its new ones too)
    block_table: torch.Tensor | None = None,  # paged: [B, max_blocks] int32 block ids
    block_size: int = 16,
    out: torch.Tensor | None = None,
    work_cache: dict | None = None,
) -> torch.Tensor:
    """Attention of every sequence of a flat batch in one launch; see the module's docstring. Returns `out`
    ([T, heads, head_dim], q's dtype). The last dimension of q, k, v and out must be contiguous. `work_cache`: a
    dict that lives as long as `query_start` holds these values (one step, one tower call): the program work list
    is then built once for all the layers that share it, not once per layer."""
    if triton is None:
        raise RuntimeError("Triton is not installed: the Triton attention path is unavailable")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
    paged = block_table is not None
    if paged and seq_lens is None:
        raise ValueError("paged attention needs seq_lens")
    if out is None:
        out = torch.empty_like(q)
    for t in (q, k, v, out):
        if t.stride(-1) != 1:
            raise ValueError("varlen_attention needs the head dimension contiguous")
    group = heads // kv_heads
    group_pad = max(_next_pow2(group), 1)
    if max_query_len <= 1:
        block_q = max(1, 16 // group_pad)  # a decode row: its query heads are the tile's rows (at least 16)
    else:
        block_q = max(1, BLOCK_ROWS_PREFILL // group_pad)
    if block_q * group_pad < 16:  # tl.dot wants at least 16 rows
        block_q = 16 // group_pad
    num_seqs = query_start.shape[0] - 1
    key = (block_q, q.shape[0])
    if work_cache is not None and key in work_cache:
        work_seq, work_block = work_cache[key]
    else:
        work_seq, work_block = work_list(query_start, block_q, q.shape[0])
        if work_cache is not None:
            work_cache[key] = work_seq, work_block
    grid = (work_seq.shape[0], kv_heads)
    dummy = query_start  # an unused pointer argument (not paged)
    _varlen_attention_kernel[grid](
        q, k, v, out,
        query_start, seq_lens if paged else dummy, block_table if paged else dummy, work_seq, work_block, num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0) if paged else 0, block_size, scale,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=BLOCK_KEYS,
        HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), PAGED=paged, CAUSAL=causal,
        IEEE=q.dtype == torch.float32,
    )
    return out


def work_list(query_start: torch.Tensor, block_q: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, block of query tokens) of every program, as two int32 tensors on query_start's device, built
    with device ops only (no host sync; CUDA-graph safe). Their length is fixed by the shapes alone, an upper
    bound of the blocks any batch of `num_tokens` tokens in this many sequences has; spare entries name
    sequence `num_seqs` (the kernel skips them)."""
    num_seqs = query_start.shape[0] - 1
    capacity = -(-num_tokens // block_q) + num_seqs
    lengths = (query_start[1:] - query_start[:-1]).to(torch.int64)
    blocks_end = torch.cumsum((lengths + block_q - 1) // block_q, 0)  # [S] last block (exclusive) of each seq
    index = torch.arange(capacity, device=query_start.device)
    seq = torch.searchsorted(blocks_end, index, right=True)  # == num_seqs past the last block
    before = torch.cat([blocks_end.new_zeros(1), blocks_end])[seq]
    return seq.to(torch.int32), (index - before).to(torch.int32)
