"""vlserve's own kernels: cpu_kernels (compiled C++ for the CPU paths) and triton_attention (the CUDA path)."""

from __future__ import annotations

import functools


@functools.cache
def triton_kernels():
    """The triton_attention module, imported on first use: importing Triton takes ~0.3 s that a CPU engine never
    needs. Cached, so the attention layers (called per layer and step on the Triton path) look it up once."""
    from vlserve.model.kernels import triton_attention

    return triton_attention
