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
FP32_CLEARLY_FASTER = 0.85  # fp32 is taken when it needs at most 85 % of bf16's time
SLOW_PATH_FACTOR = 5.0  # a first bf16 run this many times fp32's: a slow path behind the flags, stop there


@dataclass(frozen=True)
class GemmRates:
    """Milliseconds of the workload's GEMMs in each dtype, and the prefill GEMM's rate (GFLOP/s) in each."""

    fp32_ms: float
    bf16_ms: float
    fp32_gflops: float
    bf16_gflops: float

    def __post_init__(self):
        for name, value in asdict(self).items():  # (read back from a file: numbers, or it is measured again)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} = {value!r}")

    @property
    def bf16_pays(self) -> bool:
        """bf16 unless fp32 is clearly faster: near parity the answer must not flip from one run to the next
        (bf16 was the choice before anything was measured, and it halves the memory)."""
        return self.fp32_ms >= FP32_CLEARLY_FASTER * self.bf16_ms

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
    """With the threads a model process of this budget runs (core.cpu_budget.plan_threads), not this process's
    default of one per visible core."""
    from vlserve.core.cpu_budget import plan_threads

    before = torch.get_num_threads()
    torch.set_num_threads(plan_threads(None).torch_threads)
    try:
        return _measure()
    finally:
        torch.set_num_threads(before)


def _measure() -> GemmRates:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.02
    prefill = torch.randn(PREFILL_ROWS, IN_FEATURES, generator=gen)
    decode = prefill[:DECODE_ROWS]
    out: dict[str, float] = {}
    flops = 2 * PREFILL_ROWS * IN_FEATURES * OUT_FEATURES
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        fn = _linear(weight.to(dtype))
        x = prefill.to(dtype)
        t0 = time.perf_counter()
        fn(x)  # (the warm-up, timed: a slow path shows here already)
        first_ms = (time.perf_counter() - t0) * 1e3
        if name == "bf16" and first_ms > SLOW_PATH_FACTOR * out["fp32_ms"]:
            return GemmRates(out["fp32_ms"], first_ms * (1 + DECODE_STEPS), out["fp32_gflops"],
                             flops / (first_ms / 1e3) / 1e9)
        p_ms = _best_ms(fn, x)
        d_ms = _best_ms(fn, decode.to(dtype).contiguous())
        out[f"{name}_ms"] = p_ms + DECODE_STEPS * d_ms
        out[f"{name}_gflops"] = flops / (p_ms / 1e3) / 1e9
    return GemmRates(**out)


def _folders() -> list[Path]:
    """Where the answer is kept: beside the CPU kernels, else (a kernel cache this user cannot write, as in the
    container image) the user's own cache folder."""
    from vlserve.model.kernels.cpu_kernels import cache_root, user_cache_dir

    own = user_cache_dir()
    return [cache_root()] + ([own] if own != cache_root() else [])


def _read(path: Path) -> GemmRates | None:
    try:
        return GemmRates(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def cached_rates(isa: str) -> GemmRates | None:
    """The rates for this CPU, from the cache when measured before (by any process), else measured now (and
    kept). None when they cannot be measured here (said in the log): the CPU's flags decide alone then."""
    # (not the thread count: the ratio decides, and every process of a server must decide alike)
    key = hashlib.sha256(f"{_cpu_model()}|{isa}|{torch.__version__}|"
                         f"{os.environ.get('VLSERVE_PACKED_LINEAR', '1')}".encode()).hexdigest()[:16]
    rates = None
    for folder in _folders():
        path = folder / f"gemm-rates-{key}.json"
        if (rates := _read(path)) is not None:
            return rates
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together measure once and agree
                if (rates := _read(path)) is not None:
                    return rates
                rates = _measured()
                if rates is None:
                    return None
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(asdict(rates)))
                os.replace(tmp, path)
                return rates
        except OSError as e:  # not writable here: the next folder (a measurement already made is kept)
            logger.debug("GEMM rates not cached in %s (%s)", folder, e)
            if rates is not None:
                return rates
    return _measured()


def _measured() -> GemmRates | None:
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - e.g. oneDNN refusing a kernel: no measurement, never a failed start
        logger.warning("bf16 against fp32 GEMMs could not be measured here (%s: %s): dtype auto follows the CPU's "
                       "flags", type(e).__name__, e)
        return None
