"""RMSNorm as Qwen2 computes it (on CPU in one fused kernel pass: bf16 results bit-identical, fp32 ones within
an ulp, the sum of squares taken in another order)."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.kernels import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.for_tensor(x) if x.dtype == self.weight.dtype else None
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, cpu_kernels.isa_cap())
        # Normalise in fp32, scale in the input dtype: same rounding as the reference implementation.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight is stored as an offset from 1 (scale = 1 + w), applied in fp32, rounded once."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm: RMSNorm (plain weight) times silu(gate), the gate in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * torch.nn.functional.silu(gate.float())).to(dtype)
