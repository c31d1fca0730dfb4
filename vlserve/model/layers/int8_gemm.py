"""int8 x int8 GEMMs for many rows on CPU: activations quantized per row as they come, weights as stored.

A prefill chunk is compute-bound, and int8 products run several times fp32's rate where the CPU has them (oneDNN
behind `torch._int_mm`: VNNI's `vpdpbusd`, AMX tiles). Each row of activations gets its own
scale (symmetric, its largest magnitude -> the largest code); the int32 products are scaled back by the row's and
the output channel's scales.

Without VNNI the products of a pair of bytes are summed in 16 bits, which saturates for 8-bit codes on both sides
(oneDNN shifts the left operand to unsigned: 255 x 127 x 2 > 32767). There the weights go on the left and the
activations get 7-bit codes (255 x 63 x 2 fits), as PyTorch's own dynamic quantization reduces its range there.
Which of the two holds is asked of the library once per process by products whose exact values are known, not
guessed from the CPU's flags (an `ONEDNN_MAX_CPU_ISA` limit counts too), and the products are timed against an fp32
GEMM: torch runs `_int_mm` through oneDNN only where the CPU has VNNI, elsewhere as a plain loop.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from vlserve.model.kernels import cpu_kernels

logger = logging.getLogger(__name__)

ENV_SWITCH = "VLSERVE_INT8_ACTIVATIONS"  # "0": weight-only int8 everywhere (activations stay in the compute dtype)


@functools.cache
def activation_bits() -> int:
    """8 where 8-bit codes on both sides multiply exactly, 7 where only 7-bit activations do (oneDNN without VNNI),
    0 where neither holds, where int8 products are not clearly faster than fp32 GEMMs here (torch runs `_int_mm` as
    a plain loop on CPUs without VNNI: exact, and ~20x slower than the weight-only path), or where the switch is
    off; 0 means the caller expands the weight instead."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not hasattr(torch, "_int_mm"):
        return 0
    for bits in (8, 7):
        if all(_exact(bits, m, k, n) for m, k, n in ((40, 256, 64), (256, 512, 128))):
            int8_ms, fp32_ms = _speeds(bits)
            if int8_ms > FASTER_THAN_FP32 * fp32_ms:
                logger.info("int8 GEMMs for prefill: not used (int8 products %.2f ms against fp32 %.2f ms here): "
                            "int8 weights are expanded for prefill", int8_ms, fp32_ms)
                return 0
            logger.info("int8 GEMMs for prefill: %d-bit activations (exact here; %.2f ms against fp32 %.2f ms)",
                        bits, int8_ms, fp32_ms)
            return bits
    logger.warning("int8 x int8 products are not exact here: int8 weights are expanded for prefill instead")
    return 0


DOT_BLOCK = 32  # activation values per scale in decode's int8 x int8 products (the kernel's; llama.cpp's Q8_0 too)


@functools.cache
def decode_dot_isa(cap: int) -> int:
    """How decode rows (the CPU kernel's few rows) multiply int8 weights: 2 with AVX-512 VNNI dot products, 1 with
    AVX2 byte products (the activations quantized in blocks of DOT_BLOCK values, each block with its own scale), 0
    keeping them in the compute dtype (no such instructions under this ISA cap, or the switch is off). These are
    vlserve's own kernels, so the CPU's flags decide, not a library's chosen path."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return 0
    kernels = cpu_kernels.load()
    isa = kernels.int8_dot_isa(cap) if kernels is not None else 0
    logger.info("int8 decode: %s", {2: "int8 x int8 dot products (AVX-512 VNNI)", 1: "int8 x int8 byte products "
                                    "(AVX2)", 0: "activations in the compute dtype"}[isa])
    return isa


def clear_cached_choices() -> None:
    """Forget what this process chose (for a switch or an ISA cap changed in a test)."""
    activation_bits.cache_clear()
    decode_dot_isa.cache_clear()


FASTER_THAN_FP32 = 0.8  # int8 products are used where they take at most this share of the fp32 GEMM's time
SPEED_SHAPE = (128, 1024, 1024)  # rows, in, out: a small prefill GEMM
SLOW_PATH_FACTOR = 5.0  # a first int8 call this many times fp32's best: a slow path, no more timing


def _speeds(bits: int) -> tuple[float, float]:
    """Best milliseconds of the int8 products and of the fp32 GEMM of SPEED_SHAPE (the first int8 call alone when it
    shows a slow path)."""
    m, k, n = SPEED_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    codes, wq = torch.randint(-63, 64, (m, k), dtype=torch.int8), torch.randint(-127, 128, (n, k), dtype=torch.int8)

    def best(fn, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return min(times)

    fp32_ms = best(lambda: torch.nn.functional.linear(x, w), 4)
    first = best(lambda: _products(bits, codes, wq), 1)  # (oneDNN picks its kernel here)
    if first > SLOW_PATH_FACTOR * fp32_ms:
        return first, fp32_ms
    return best(lambda: _products(bits, codes, wq)), fp32_ms


def _exact(bits: int, m: int, k: int, n: int) -> bool:
    """The largest codes (where a 16-bit pair sum would saturate), and random ones, against exact integers."""
    top = 2 ** (bits - 1) - 1
    g = torch.Generator().manual_seed(bits)
    cases = [(torch.full((m, k), top, dtype=torch.int8), torch.full((n, k), 127, dtype=torch.int8)),
             (torch.full((m, k), -top, dtype=torch.int8), torch.full((n, k), 127, dtype=torch.int8)),
             (torch.randint(-top, top + 1, (m, k), generator=g, dtype=torch.int8),
              torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))]
    try:
        return all(torch.equal(_products(bits, x, w).long(), x.long() @ w.long().t()) for x, w in cases)
    except RuntimeError:
        return False


def _products(bits: int, xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = xq [M, K] @ w [N, K]^T, with the operand order that is exact for `bits` (for 7 bits, a
    transposed view of [N, M])."""
    return torch._int_mm(xq, w.t()) if bits == 8 else torch._int_mm(w, xq.t()).t()


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 codes [M, K], fp32 scales [M, 1]); a row of zeros gets codes 0 (and the smallest normal
    scale), a row with a NaN a NaN scale. One pass a row in vlserve's CPU kernels where they are built, else these
    torch passes (the same arithmetic)."""
    top = 2 ** (bits - 1) - 1
    if (kernels := cpu_kernels.for_tensor(x)) is not None:
        return tuple(kernels.quantize_rows(x.contiguous(), top, cpu_kernels.isa_cap()))
    x = x.float()
    low, high = torch.aminmax(x, dim=1, keepdim=True)
    scale = torch.maximum(-low, high).div_(top).clamp_min_(torch.finfo(torch.float32).tiny)  # (NaN stays NaN)
    codes = torch.div(x, scale)  # in place from here: one temporary
    return codes.round_().clamp_(-top, top).nan_to_num_(0.0).to(torch.int8), scale


def int8_linear(x: torch.Tensor, weight_rows, out_features: int, scale: torch.Tensor, bits: int,
                chunk_rows: int) -> torch.Tensor:
    """x [M, K] (any float dtype) @ an int8 weight [N, K] with per-channel `scale` [N] -> [M, N] in x's dtype.
    `weight_rows(a, b)` gives output channels [a, b) as plain int8 rows, asked `chunk_rows` at a time (an LM head's
    vocabulary unpacked at once would be a large temporary)."""
    codes, row_scale = quantize_rows(x, bits)
    outs = []
    for a in range(0, out_features, chunk_rows):
        b = min(out_features, a + chunk_rows)
        outs.append(scale_products(_products(bits, codes, weight_rows(a, b)), row_scale, scale[a:b], x.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def scale_products(products: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """int32 [M, N] (row-major, or a transposed view) x row_scale [M, 1] x col_scale [N] in fp32 -> `dtype`
    [M, N], row-major."""
    if dtype in cpu_kernels.KERNEL_DTYPES and (kernels := cpu_kernels.for_tensor(row_scale)) is not None:
        return kernels.scale_products(products, row_scale, col_scale.float().contiguous(), dtype)
    # converted and made row-major in one pass, then scaled in place
    out = products.to(torch.float32, memory_format=torch.contiguous_format).mul_(row_scale).mul_(col_scale)
    return out.to(dtype)
