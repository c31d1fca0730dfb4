"""Rotary position embeddings: the rotation itself and the angles of `[k, n]` positions, each frequency following
one position row (Qwen2-VL's M-RoPE with k = 3; plain RoPE with one row), with Llama's frequency scaling for the
LLaVA family's Llama LMs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from vlserve.model.config_types import RopeScaling
from vlserve.model.kernels import cpu_kernels


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (broadcast over heads)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rotate_heads_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary in place on the first `heads` heads of x [tokens, all heads, head_dim]; returns x.

    cos/sin in x's dtype: computed in that dtype, as `apply_rotary` does (the LMs). cos/sin in fp32 with x in a
    lower precision: computed in fp32 and rounded once (the vision towers). On CPU one fused kernel pass
    (bit-identical to the torch ops, which remain the fallback).
    """
    kernels = cpu_kernels.for_tensor(x)
    if kernels is not None and cos.dtype in (x.dtype, torch.float32) and x.stride(-1) == 1 \
            and x.stride(1) == x.shape[2]:
        kernels.rotary_(x, cos.contiguous(), sin.contiguous(), heads, cpu_kernels.isa_cap())
        return x
    x[:, :heads] = apply_rotary(x[:, :heads].to(cos.dtype), cos, sin).to(x.dtype)
    return x


def frequency_rows(sections: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position row (M-RoPE's 0 = t, 1 = h, 2 = w) drives each of the head_dim/2 frequencies.

    Bands: consecutive runs of `sections` sizes (Qwen2-VL). Interleaved (Qwen3-VL): frequencies cycle rows 0, 1,
    2, with rows 1 and 2 each stopping after its own section's count, the rest left to row 0.
    """
    cpu = torch.device("cpu")  # explicit: construction may run under a meta-device context
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long, device=cpu) for i, n in enumerate(sections)])
    j = torch.arange(sum(sections), device=cpu)
    row = torch.zeros_like(j)
    row[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    row[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return row


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim/2] fp32 rotation speeds, scaled as transformers' "linear" / "llama3" RoPE types do."""
    cpu = torch.device("cpu")  # explicit: construction may run under a meta-device context
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    old_len, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class SectionedRotaryEmbedding(nn.Module):
    """Rotary angles of `[k, T]` positions, each frequency following one position row (see `frequency_rows`).

    Where a token's rows are equal (text) it is plain 1D RoPE.
    """

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, ...], interleaved: bool = False,
                 scaling: RopeScaling | None = None):
        super().__init__()
        # Plain attributes, not buffers: they must stay fp32 whatever dtype the weights are cast to, and
        # survive meta-device construction. Copied to the positions' device on first use.
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        rows = frequency_rows(sections, interleaved)
        self._tables = {torch.device("cpu"): (inv_freq, rows)}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device not in self._tables:
            self._tables[positions.device] = tuple(t.to(positions.device) for t in self._tables[torch.device("cpu")])
        inv_freq, rows = self._tables[positions.device]
        freqs = positions.unsqueeze(-1).float() * inv_freq  # [k, T, head_dim/2]
        freqs = freqs.gather(0, rows.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)
