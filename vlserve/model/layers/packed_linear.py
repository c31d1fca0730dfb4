"""CPU linears on oneDNN-prepacked weights (bf16 and fp32).

torch's default `F.linear` streams weights at ~20-30 GB/s (bf16) and ~10-20 GB/s (fp32) for the small row counts
of decode steps. With the weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`)
the same product runs 2-4x faster at 1-16 rows and ~1.2x faster at prefill sizes. bf16 results are
bit-identical; fp32 ones differ from MKL's in the last bits (another summation order, ~1e-6 relative), which
the fp32 parity tests against transformers tolerate (they stay token-exact).
Set VLSERVE_PACKED_LINEAR=0 to turn it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from vlserve.model.hardware import detect

DECODE_BATCH_HINT = 16  # oneDNN picks its blocking for this row count; any row count still works


def packed_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on any CPU oneDNN runs on; bf16 only where oneDNN can pack bf16 weights (never on AVX2-only CPUs: it
    raises there)."""
    if device.type != "cpu" or os.environ.get("VLSERVE_PACKED_LINEAR", "1") == "0":
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and detect().onednn_bf16_packing)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not Parameters: the packed tensor is opaque and never trained or saved.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Swaps every nn.Linear of `model` for a PackedLinear in place; returns how many were swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                packed = PackedLinear(child.weight, child.bias)
                if hasattr(child, "tp_rules"):  # how the layer is split stays known (LoRA cuts its adapters by it)
                    packed.tp_rules = child.tp_rules
                setattr(module, name, packed)
                swapped += 1
    return swapped
