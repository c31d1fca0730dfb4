"""Mixture-of-experts MLP as two grouped GEMM launches: the CUDA path of `layers/moe.py` `Experts`.

The (token, expert) pairs of a pass are sorted by expert and laid out in blocks of BLOCK_M rows, each block
holding pairs of one expert only (an expert's last block padded with a sentinel). One launch multiplies every
block by its expert's `gate_up_proj` (rows read from the token's input), the activation runs over all pairs at
once, and a second launch multiplies by `down_proj`; the routing weights scale each pair's row and a token's
rows are added in ascending expert order, as the reference and the other paths of `Experts` add them.
There is no Python loop over experts and no host sync: every size is fixed by the batch's token count (the
layout's padding is sized for the worst case), so a decode step runs inside a CUDA graph unchanged.
fp32 operands multiply in IEEE fp32 (no TF32), like the attention kernel, so fp32 parity stays exact to the
token; bf16/fp16 operands accumulate in fp32.

Where CUDA is absent the kernel runs in Triton's interpreter (kernels/triton_runtime.py): tests only.
"""

from __future__ import annotations

import torch

from vlserve.model.kernels.triton_runtime import tl, triton

BLOCK_M = 16  # pairs per block: decode batches give each expert few rows
BLOCK_N = 64
BLOCK_K = 32


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_experts_ptr,
        num_pairs, N, K,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        """out[pair] = a[row of pair] @ w[expert of its block]^T for the pairs of block program_id(0), columns
        of tile program_id(1). ROWS_PER_TOKEN: `a` has a row per token (pair // TOP_K), else one per pair."""
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block).to(tl.int64)
        if expert < 0:  # a spare block of the worst-case layout
            return
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pair_ids_ptr + offs_m).to(tl.int64)  # offsets past 2^31 elements on big passes
        valid = pairs < num_pairs  # the sentinel pads an expert's last block
        if ROWS_PER_TOKEN:
            rows = pairs // TOP_K
        else:
            rows = pairs
        rows = tl.where(valid, rows, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def expert_layout(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (pair_ids [blocks * block_m]: pair t*k+j at its place in its expert's blocks, T*k where
    a block is padded; block_experts [blocks]: each block's expert, -1 for the spare ones). The number of blocks
    is the most any routing of T*k pairs can need; only tensor ops of fixed sizes (no host sync: graph-safe)."""
    flat = experts.reshape(-1).long()
    pairs = flat.numel()
    max_blocks = (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m + 1  # at most one part-block each
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first_row = (block_end - blocks) * block_m  # each expert's first row in the padded layout
    order = torch.argsort(flat, stable=True)  # pairs by expert, in pair order within one
    by_expert = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    pair_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    pair_ids[first_row[by_expert] + rank] = order.to(torch.int32)
    block_index = torch.arange(max_blocks, device=flat.device)
    owner = torch.searchsorted(block_end, block_index, right=True)
    block_experts = torch.where(block_index < block_end[-1], owner, -1).to(torch.int32)
    return pair_ids, block_experts


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor, block_experts: torch.Tensor,
                  num_pairs: int, top_k: int, rows_per_token: bool) -> torch.Tensor:
    """[num_pairs, N]: each pair's row of `a` times its expert's w [E, N, K] transposed."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, out, pair_ids, block_experts, num_pairs, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        TOP_K=top_k, ROWS_PER_TOKEN=rows_per_token, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=a.dtype == torch.float32,
    )
    return out


def fused_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, act) -> torch.Tensor:
    """x [T, H], experts/weights [T, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] -> [T, H]: the sum over
    each token's k experts of weight * down(act(gate) * up), added in ascending expert order."""
    T, top_k = experts.shape
    order = torch.argsort(experts, dim=1)  # each token's experts ascending: the order their products are added
    experts, weights = experts.gather(1, order), weights.gather(1, order)
    pair_ids, block_experts = expert_layout(experts, gate_up_proj.shape[0])
    num_pairs = T * top_k
    gate_up = _grouped_gemm(x, gate_up_proj, pair_ids, block_experts, num_pairs, top_k, rows_per_token=True)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (act(gate) * up).contiguous()
    y = _grouped_gemm(hidden, down_proj, pair_ids, block_experts, num_pairs, top_k, rows_per_token=False)
    y = (y * weights.reshape(-1, 1)).view(T, top_k, y.shape[-1])
    out = y[:, 0]
    for j in range(1, top_k):
        out = out + y[:, j]
    return out
