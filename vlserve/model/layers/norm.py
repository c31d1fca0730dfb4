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
