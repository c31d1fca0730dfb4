"""Gated DeltaNet's sequence mixing (Qwen3.5's linear attention), pure torch: a causal depthwise conv with a
carried state, and the gated delta rule in two forms: chunked (prefill spans) and one step (decode rows).

The delta rule keeps per value head a matrix S [key_dim, value_dim]. Token t decays it by exp(g_t), then writes
v_t where k_t points, by the amount beta_t, correcting what S already stored there:

    S = exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

The chunked form does the same in blocks of 64 tokens (the WY / UT-transform form of DeltaNet): inside a block
everything is a few matmuls and one triangular solve; only the block-to-block carry is a Python loop. All
recurrence math is fp32 (as transformers'), whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlserve.model.kernels import cpu_kernels

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- causal depthwise conv ---------------------------------------------------------------------------------
def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's span. x: [T, C] new inputs; weight: [C, K]; state: [C, K-1], the previous K-1 inputs
    (zeros at the start). Returns silu(conv) [T, C] and `window` [C, K-1+T], the state followed by the inputs:
    the state after the first n tokens is `window[:, n : n + K - 1]`."""
    window = torch.cat([state.to(x.dtype), x.t()], dim=-1)
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out).squeeze(0).t().to(x.dtype), window


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of B sequences. x: [B, C]; state: [B, C, K-1]. Returns silu(conv) [B, C] and the
    new states [B, C, K-1]."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [B, C, 1]
    return F.silu(out).squeeze(-1).to(x.dtype), window[..., 1:]


# ---- the gated delta rule ----------------------------------------------------------------------------------
def _prepare(q, k, v, g, beta):
    """fp32, unit-length q/k (q also scaled by 1/sqrt(key_dim)), key heads repeated to the value heads."""
    rep = v.shape[-2] // k.shape[-2]
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    if rep > 1:  # each key head serves `rep` consecutive value heads
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. q, k: [B, Hk, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state
    [B, H, Dk, Dv] fp32. Returns the output [B, H, Dv] (v's dtype) and the new state."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None, None]
    stored = (k.unsqueeze(-2) @ s).squeeze(-2)  # what S holds at k: [B, H, Dv]
    delta = (v - stored) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ s).squeeze(-2)
    return out.to(dtype), s


def gated_delta_step_in_pool(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor,
                             fresh: torch.Tensor) -> torch.Tensor:
    """`gated_delta_step` for B sequences whose states live in `pool` [slots, H, Dk, Dv] (fp32) at `slots`
    (distinct), updated in place; `fresh` [B] bool: that sequence starts from a zero state. Returns the output
    [B, H, Dv] (v's dtype). On the CPU with vlserve's kernels: one fused pass pair over each state, in place (the
    torch path gathers, decays, updates and scatters the states: about five times the memory traffic)."""
    kernels = cpu_kernels.for_tensor(pool, (torch.float32,))
    if kernels is None:
        keep = ~fresh.to(pool.device)
        state = torch.where(keep[:, None, None, None], pool.index_select(0, slots), 0)
        out, state = gated_delta_step(q, k, v, g, beta, state)
        pool.index_copy_(0, slots, state)
        return out
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = kernels.gated_delta_step(pool, slots.contiguous(), fresh.contiguous(), q.contiguous(), k.contiguous(),
                                   v.contiguous(), g.contiguous(), beta.contiguous(), cpu_kernels.isa_cap())
    return out.to(dtype)


def chunk_gated_delta(q, k, v, g, beta, state: torch.Tensor | None, offsets: list[int] = (),
                      chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's span of T tokens. q, k: [T, Hk, Dk]; v: [T, H, Dv]; g, beta: [T, H]; state [H, Dk, Dv]
    fp32 (None: zeros). Returns the output [T, H, Dv] (v's dtype), the state after the span and the states after
    the first n tokens for each n in `offsets` (1 <= n <= T)."""
    dtype = v.dtype
    T, H, Dv = v.shape
    if any(not 1 <= off <= T for off in offsets):
        raise ValueError(f"state offsets {list(offsets)} must lie within 1..{T}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    Dk = k.shape[-1]
    pad = -T % chunk
    n = (T + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [n, H, chunk, ...], zero-padded: padding tokens neither decay nor write
        x = F.pad(x, (0, 0, 0, 0, 0, pad) if x.dim() == 3 else (0, 0, 0, pad))
        return x.reshape(n, chunk, H, *x.shape[2:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = map(blocks, (q, k, v, g, beta))
    decay = g.cumsum(-1)  # log of the decay from the block's start through each token: [H, n, chunk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # pair_decay[i, j] = decay from token j to token i (i >= j), 0 above the diagonal
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # UT transform: the block's sequential writes as one triangular system (unit diagonal)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay  # within-block attention
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]  # [n, H, 1, 1]

    s = torch.zeros(H, Dk, Dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty(n, H, chunk, Dv, dtype=torch.float32, device=q.device)
    wanted: dict[int, list[int]] = {}
    for pos, off in enumerate(offsets):
        wanted.setdefault((off - 1) // chunk, []).append(pos)
    found: list[torch.Tensor | None] = [None] * len(offsets)
    for i in range(n):
        v_new = u[i] - w[i] @ s  # the block's writes, corrected by what S already holds
        out[i] = q_decayed[i] @ s + intra[i] @ v_new
        for pos in wanted.get(i, ()):  # the state after the first p tokens of this block
            p = offsets[pos] - i * chunk
            last = decay[i, :, p - 1 : p]  # [H, 1]
            k_p = k[i, :, :p] * (last - decay[i, :, :p]).exp().unsqueeze(-1)
            found[pos] = s * last.exp().unsqueeze(-1) + k_p.transpose(-1, -2) @ v_new[:, :p]
        s = s * block_decay[i] + k_to_end[i].transpose(-1, -2) @ v_new
    out = out.transpose(1, 2).reshape(n * chunk, H, Dv)[:T].to(dtype)
    return out, s, found
