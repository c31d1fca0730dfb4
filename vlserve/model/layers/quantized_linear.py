"""Quantized linears: int8 per output channel, and int4 in groups (AWQ / GPTQ checkpoints).

A decode step reads every weight once for a few rows, so it is memory-bound and runs on vlserve's CPU kernels (int8
reads a quarter of fp32's bytes, int4 an eighth). int8 there multiplies bytes by bytes, the activations quantized in
blocks of 32 values with a scale each (`int8_gemm.decode_dot_isa`: AVX-512 VNNI or AVX2; expanding each weight
byte to a float took more instructions than the memory took to deliver it); int4, and int8 where neither
instruction set is there, keep the activations in the compute dtype (fp32 accumulation, the weight expanded in
registers), as do int8 linears whose input width is not a multiple of 32. Past `KERNEL_MAX_ROWS` rows (prefill) a
step is compute-bound: on CPU, int8 runs as int8 x int8 GEMMs with the activations quantized per row
(`int8_gemm`); otherwise (int4, CUDA, or no exact int8 products) the weight is expanded to the compute dtype once
for the call and goes through the dense GEMM. `VLSERVE_INT8_ACTIVATIONS=0` keeps int8's activations in the compute
dtype on every path.

int4 layout here (`pack_int4`): per 32 input channels, byte i holds channel i (low nibble) and channel 16 + i
(high nibble), so one vector load unpacks into two runs of consecutive channels. Zeros are kept as floats,
the weight is `(q - zero) * scale` per group of `group_size` input channels.

Both weights are stored interleaved by 4 output rows (`interleave4`): the kernel reads a tile of 4 rows as one
sequential stream, which memory prefetchers keep up with (four short streams got half the bandwidth). A tile is
4 whole rows, so rows [a, b) with a, b multiples of 4 are still bytes [a, b) x row bytes: the loader fills fused
q/k/v and gate/up rows as before.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.model.kernels import cpu_kernels
from vlserve.model.layers import int8_gemm

KERNEL_MAX_ROWS = 32  # up to this many rows the kernel beats expanding the weight for a dense GEMM
DENSE_CHUNK_ROWS = 8192  # past the kernel's rows, without the kernels, a weight is expanded this many rows at a time
EXPAND_BYTES = 2 << 20  # with them, this much of it (in fp32): a piece stays in cache for its GEMM


def interleave4(t: torch.Tensor) -> torch.Tensor:
    """[N, B] bytes (N % 4 == 0, B % 16 == 0) -> the same shape, each 16-byte run of 4 rows side by side."""
    n, b = t.shape
    return t.view(n // 4, 4, b // 16, 16).transpose(1, 2).reshape(n, b)


def deinterleave4(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `interleave4`. The 16-byte runs are moved as complex128 elements: one copy at nearly memcpy's
    rate (moved as bytes in that order, 3-4x slower). Only bits are moved, no arithmetic: no value changes."""
    n, b = t.shape
    runs = torch.view_as_complex(t.contiguous().view(torch.float64).view(n // 4, b // 16, 4, 2))
    return torch.view_as_real(runs.transpose(1, 2).contiguous()).view(t.dtype).view(n, b)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 -> [N, K/2] uint8 in the layout above, interleaved (N % 4 == 0, K % 32 == 0)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return interleave4((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K/2] uint8 -> [N, K] uint8 values 0..15."""
    n, half = packed.shape
    blocks = deinterleave4(packed).view(n, half // 16, 1, 16)
    return torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(n, half * 2)


def _expand_rows(in_features: int) -> int:
    """Output rows of an int8 weight expanded at once on CPU: ~EXPAND_BYTES of fp32, a multiple of 4."""
    return max(4, EXPAND_BYTES // (4 * in_features) // 4 * 4)


def _kernel_for(x: torch.Tensor):
    """The compiled kernels when they apply to `x` (CPU, few rows), else None."""
    if x.numel() // x.shape[-1] > KERNEL_MAX_ROWS:
        return None
    return cpu_kernels.for_tensor(x, (*cpu_kernels.KERNEL_DTYPES, torch.float16))  # converted to fp32 inside


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y + bias, into `y` (a linear's fresh output) where the dtypes agree: one pass over cold memory fewer per
    call, which batch-1 decode pays a dozen times a token."""
    if bias is None:
        return y
    return y.add_(bias) if y.dtype == bias.dtype else y + bias


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias, q int8 [N, K] (stored interleaved), one fp32 scale per output channel
    (symmetric)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), False) if bias else None

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return Int8Linear.fits(linear.weight)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """The kernel tiles 4 output rows by 16 input channels."""
        return weight.dim() == 2 and weight.shape[0] % 4 == 0 and weight.shape[1] % 16 == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        if not cls.supports(linear):
            raise ValueError(f"int8 linear needs out_features % 4 == 0 and in_features % 16 == 0, got {linear}")
        module = cls.from_weight(linear.weight, linear.bias)
        if hasattr(linear, "tp_rules"):  # how the layer is split stays known (LoRA cuts its adapters by it)
            module.tp_rules = linear.tp_rules
        return module

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """The int8 copy of a [out, in] weight (e.g. a tied LM head's embedding table, which stays as it is)."""
        out_features, in_features = weight.shape
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        module = cls(in_features, out_features, bias is not None, weight.dtype, weight.device)
        module.qweight.copy_(interleave4(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)))
        module.scale.copy_(scale)
        if bias is not None:
            module.bias.data.copy_(bias.detach())
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (deinterleave4(self.qweight).float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernel_for(x)
        if kernels is not None:
            cap = cpu_kernels.isa_cap()
            if self.in_features % int8_gemm.DOT_BLOCK == 0 and int8_gemm.decode_dot_isa(cap):
                y = kernels.int8_dot_linear(x.contiguous(), self.qweight, self.scale, cap)
            else:
                y = kernels.int8_linear(x.contiguous(), self.qweight, self.scale, cap)
        elif x.device.type == "cpu" and (bits := int8_gemm.activation_bits()):
            # Many rows on CPU: int8 x int8 products with the activations quantized per row (several times fp32's
            # GEMM rate where the CPU multiplies bytes; see int8_gemm)
            rows = x.reshape(-1, self.in_features)
            y = int8_gemm.int8_linear(rows, lambda a, b: deinterleave4(self.qweight[a:b]), self.out_features,
                                      self.scale, bits, DENSE_CHUNK_ROWS).view(*x.shape[:-1], self.out_features)
            return _add_bias(y, self.bias)
        elif (kernels := cpu_kernels.for_tensor(x, (*cpu_kernels.KERNEL_DTYPES, torch.float16))) is not None:
            # Many rows on CPU: the weight expanded a cache-sized piece at a time (scaled), each piece a dense GEMM
            # (expanding it whole and scaling the output made a prefill 1.64x fp32's time; this, 1.24x)
            n, step, cap = self.out_features, _expand_rows(self.in_features), cpu_kernels.isa_cap()
            y = torch.cat([F.linear(x, kernels.int8_expand(self.qweight, self.scale, a, min(n, a + step), cap)
                                    .to(x.dtype)) for a in range(0, n, step)], dim=-1)
        elif self.out_features <= DENSE_CHUNK_ROWS:  # per-channel scale on the output: the GEMM sees exact integers
            y = F.linear(x, deinterleave4(self.qweight).to(x.dtype)) * self.scale.to(x.dtype)
        else:  # an LM head: expanding a 150k-word vocabulary at once would be a GB-sized temporary
            y = torch.cat([F.linear(x, deinterleave4(q).to(x.dtype)) * s.to(x.dtype) for q, s in
                           zip(self.qweight.split(DENSE_CHUNK_ROWS), self.scale.split(DENSE_CHUNK_ROWS))], dim=-1)
        return _add_bias(y, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """y = x @ W^T + bias with W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group_size."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, dtype: torch.dtype,
                 device=None):
        super().__init__()
        if in_features % group_size or group_size % 32 or out_features % 4:
            raise ValueError(f"int4 linear: in_features {in_features} must be a multiple of the group size "
                             f"{group_size}, itself a multiple of 32, and out_features {out_features} of 4")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), False) if bias else None

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, g = self.out_features, self.group_size
        q = unpack_int4(self.packed).float().view(n, -1, g)
        return ((q - self.zeros[..., None]) * self.scales[..., None]).view(n, -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernel_for(x)
        if kernels is not None:
            y = kernels.int4_linear(x.contiguous(), self.packed, self.scales, self.zeros, self.group_size,
                                    cpu_kernels.isa_cap())
        else:
            y = F.linear(x, self.dequantized_weight(x.dtype))
        return _add_bias(y, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")
