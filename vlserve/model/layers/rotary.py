"""Rotary position embeddings: the rotation itself and Qwen2-VL's multimodal (M-RoPE) angles (with Llama's
frequency scaling, for the LLaVA family's Llama LMs)."""

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


def mrope_axes(mrope_section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position axis (0 = t, 1 = h, 2 = w) drives each of the head_dim/2 frequencies.

    Qwen2-VL: three bands of `mrope_section` sizes. Qwen3-VL (interleaved): frequencies cycle t, h, w, with h
    and w each stopping after its own section's count, the rest left to t.
    """
    cpu = torch.device("cpu")  # explicit: construction may run under a meta-device context
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long, device=cpu) for i, n in enumerate(mrope_section)])
    j = torch.arange(sum(mrope_section), device=cpu)
    axis = torch.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


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


class MRotaryEmbedding(nn.Module):
    """Rotary angles where each frequency follows one of the (t, h, w) position axes (see `mrope_axes`).

    For text all three positions are equal, which makes it plain 1D RoPE.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...], interleaved: bool = False,
                 scaling: RopeScaling | None = None):
        super().__init__()
        # Plain attributes, not buffers: they must stay fp32 whatever dtype the weights are cast to, and
        # survive meta-device construction. Copied to the positions' device on first use.
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        axis = mrope_axes(mrope_section, interleaved)
        self._tables = {torch.device("cpu"): (inv_freq, axis)}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device not in self._tables:
            self._tables[positions.device] = tuple(t.to(positions.device) for t in self._tables[torch.device("cpu")])
        inv_freq, axis = self._tables[positions.device]
        freqs = positions.unsqueeze(-1).float() * inv_freq  # [3, T, head_dim/2]
        freqs = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)
