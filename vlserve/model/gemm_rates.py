"""How fast this CPU multiplies in bf16 against fp32, measured once and kept beside the CPU kernels, for
dtype="auto" (model.hardware.resolve_dtype).

The CPU's flags say whether bf16 is computed in hardware, not whether it is faster: on a Xeon with AVX-512-BF16 but
no AMX, bf16 GEMMs ran at 169 GFLOP/s where fp32 ran at 304. bf16 still halves the bytes a decode step streams, so
neither rate alone decides: the estimate is a workload of one 512-token prompt per 64 tokens generated 8 at a
time (a prefill GEMM, then 8 decode GEMMs of 8 rows), with the linears the model runs (oneDNN-prepacked where
supported, model.layers.packed_linear). Measured only where bf16 is native (emulated bf16 is ~100x slower: no
question), once per CPU model, ISA and torch version; the result is a small JSON file in the kernel cache folder,
written under a lock so processes starting together agree. (This Xeon with AMX: bf16 2,292 vs fp32 409 GFLOP/s.)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger("vlserve.hardware")
PREFILL_ROWS, DECODE_ROWS, DECODE_STEPS = 512, 8, 8  # one prompt of 512 tokens per 64 tokens generated 8 at a time
IN_FEATURES = OUT_FEATURES = 2048
REPEATS = 5


@dataclass(frozen=True)
class GemmRates:
    """Milliseconds of the workload's GEMMs in each dtype, and the prefill GEMM's rate (GFLOP/s) in each."""

    fp32_ms: float
    bf16_ms: float
    fp32_gflops: float
    bf16_gflops: float

    @property
    def bf16_pays(self) -> bool:
        return self.bf16_ms <= self.fp32_ms

    def describe(self) -> str:
        return (f"prefill GEMMs bf16 {self.bf16_gflops:.0f} vs fp32 {self.fp32_gflops:.0f} GFLOP/s; a 512-token "
                f"prompt with 64 tokens generated 8 at a time: bf16 {self.bf16_ms:.1f} vs fp32 {self.fp32_ms:.1f} ms")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _linear(weight: torch.Tensor):
    from vlserve.model.layers.packed_linear import PackedLinear, packed_linear_supported

    if packed_linear_supported(weight.device, weight.dtype):
        return PackedLinear(weight, None)
    return lambda x: torch.nn.functional.linear(x, weight)


def _best_ms(fn, x: torch.Tensor) -> float:
    fn(x)  # warm-up (oneDNN picks its kernel)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@torch.inference_mode()
def measure() -> GemmRates:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.02
    prefill = torch.randn(PREFILL_ROWS, IN_FEATURES, generator=gen)
    decode = prefill[:DECODE_ROWS]
    out: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        fn = _linear(weight.to(dtype))
        p_ms = _best_ms(fn, prefill.to(dtype))
        d_ms = _best_ms(fn, decode.to(dtype).contiguous())
        out[f"{name}_ms"] = p_ms + DECODE_STEPS * d_ms
        out[f"{name}_gflops"] = 2 * PREFILL_ROWS * IN_FEATURES * OUT_FEATURES / (p_ms / 1e3) / 1e9
    return GemmRates(**out)


def cached_rates(isa: str) -> GemmRates:
    """The rates for this CPU, from the cache when measured before (by any process), else measured now."""
    from vlserve.model.kernels.cpu_kernels import cache_root

    # (not the thread count: the ratio decides, and every process of a server must decide alike)
    key = hashlib.sha256(f"{_cpu_model()}|{isa}|{torch.__version__}|"
                         f"{os.environ.get('VLSERVE_PACKED_LINEAR', '1')}".encode()).hexdigest()[:16]
    path = cache_root() / f"gemm-rates-{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together measure once and agree
            try:
                return GemmRates(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                pass
            rates = measure()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(rates)))
            os.replace(tmp, path)
            return rates
    except OSError as e:  # no writable cache: measured each time
        logger.debug("GEMM rates not cached (%s): measured in this process", e)
        return measure()
