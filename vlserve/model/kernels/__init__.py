"""vlserve's own kernels: cpu_kernels (compiled C++ for the CPU paths), triton_attention and triton_moe (the CUDA
paths)."""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_kernels():
    """The triton_attention module, imported on first use: importing Triton takes ~0.3 s that a CPU engine never
    needs. Cached, so the attention layers (called per layer and step on the Triton path) look it up once."""
    from vlserve.model.kernels import triton_attention

    return triton_attention


FUSED_MOE_ENV = "VLSERVE_FUSED_MOE"  # "0": the expert loop on CUDA too; "1": the kernel even in the interpreter


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_usable() -> bool:
    """Triton imports (installed is not enough: a broken install keeps the MoE loop rather than fail every
    layer). Imported only here, on the first pass that would use it."""
    from vlserve.model.kernels.triton_runtime import available

    return available()


def fused_moe_wanted(x) -> bool:
    """Mixture-of-experts layers run triton_moe for this pass's input: on CUDA unless VLSERVE_FUSED_MOE=0 (or
    Triton is missing or broken); elsewhere only with VLSERVE_FUSED_MOE=1 (Triton's interpreter, for tests).
    A CPU pass decides without importing Triton."""
    setting = os.environ.get(FUSED_MOE_ENV, "")
    if setting == "0" or not (x.is_cuda or setting == "1"):
        return False
    return _triton_usable()


@functools.cache
def triton_moe_kernels():
    """The triton_moe module, imported on first use (as triton_kernels)."""
    from vlserve.model.kernels import triton_moe

    return triton_moe
