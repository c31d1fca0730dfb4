"""The one place that knows the hardware: CPU ISA, which dtypes it computes natively, CUDA.

Two CPU kinds are common and behave very differently: Intel/AMD with AVX-512-BF16 (or AMX) multiply bf16 in
hardware, while AVX2-only CPUs emulate bf16/fp16 matmuls about 100x slower than fp32, and oneDNN's bf16 weight
packing refuses to run there. Everything that depends on this (dtype="auto", packed linears) asks here.

`VLSERVE_CPU_ISA=avx2` (or `avx512`) makes this process behave as if the CPU had only that ISA: the fallback
paths can then be tested on any machine. It can only lower what the CPU really has.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vlserve.core.errors import InvalidInputError, ModelLoadError

logger = logging.getLogger("vlserve.hardware")
ISA_ENV = "VLSERVE_CPU_ISA"
ISA_ORDER = ("default", "avx2", "avx512", "avx512_bf16", "amx")  # each level includes the ones before it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Hardware:
    cpu_isa: str  # best of ISA_ORDER this CPU offers (after the VLSERVE_CPU_ISA cap)
    native_bf16: bool  # bf16 matmuls run in hardware (AVX-512-BF16 or AMX)
    native_fp16: bool  # fp16 matmuls run in hardware (AVX-512-FP16 or AMX-FP16)
    onednn_bf16_packing: bool  # oneDNN can prepack bf16 linear weights here
    cuda_devices: int
    cuda_name: str | None
    cuda_bf16: bool
    capped: bool  # VLSERVE_CPU_ISA lowered what the CPU reports

    def describe(self) -> str:
        cpu = (f"CPU {self.cpu_isa}{' (capped by ' + ISA_ENV + ')' if self.capped else ''}: bf16 "
               f"{'native' if self.native_bf16 else 'emulated (slow)'}, fp16 "
               f"{'native' if self.native_fp16 else 'emulated (slow)'}")
        gpu = f"; CUDA: {self.cuda_devices} x {self.cuda_name}" if self.cuda_devices else "; no CUDA"
        return cpu + gpu

    def native_dtypes(self, device: torch.device) -> set[torch.dtype]:
        if device.type == "cuda":
            return {torch.float32, torch.float16} | ({torch.bfloat16} if self.cuda_bf16 else set())
        return ({torch.float32} | ({torch.bfloat16} if self.native_bf16 else set())
                | ({torch.float16} if self.native_fp16 else set()))


def _cpu_isa() -> str:
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    if torch.cpu._is_avx512_supported():
        return "avx512"
    if torch.cpu._is_avx2_supported():
        return "avx2"
    return "default"


@functools.lru_cache(maxsize=None)
def detect() -> Hardware:
    real = _cpu_isa()
    isa, capped = real, False
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if cap:
        if cap not in ISA_ORDER:
            raise InvalidInputError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(ISA_ORDER)}")
        if ISA_ORDER.index(cap) < ISA_ORDER.index(real):
            isa, capped = cap, True
    level = ISA_ORDER.index(isa)
    mkldnn = torch.backends.mkldnn.is_available()
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Hardware(
        cpu_isa=isa,
        native_bf16=level >= ISA_ORDER.index("avx512_bf16"),
        native_fp16=not capped and mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
        onednn_bf16_packing=(level >= ISA_ORDER.index("avx512") and mkldnn
                             and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        cuda_devices=cuda,
        cuda_name=torch.cuda.get_device_name(0) if cuda else None,
        cuda_bf16=bool(cuda) and torch.cuda.is_bf16_supported(),
        capped=capped,
    )


_logged = False


def log_once() -> Hardware:
    """Logs what this machine computes natively, once per process."""
    global _logged
    hw = detect()
    if not _logged:
        logger.info("hardware: %s", hw.describe())
        _logged = True
    return hw


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise InvalidInputError(f"unknown device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def resolve_dtype(name: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device,
                  announce: bool = True, measure: Callable[[str], Any] | None = None) -> torch.dtype:
    """`auto`: the checkpoint's dtype where this device computes it natively, else float32 (said in the log); on a
    CPU, bf16 only where it also runs a serving workload's GEMMs faster than fp32, when `measure` (ISA -> the
    rates: model.gemm_rates.cached_rates) is given (measured once, said in the log).

    An explicit bfloat16/float16 is honoured everywhere; without native support it runs correctly but slowly,
    and the log says so.
    """
    if isinstance(name, torch.dtype):
        return name
    hw = detect()
    native = hw.native_dtypes(device)
    if name == "auto":
        wanted = DTYPES.get(checkpoint_dtype or "float32", torch.float32)
        fp16_emulated = device.type == "cpu" and torch.float16 not in native
        if wanted == torch.float16 and fp16_emulated and torch.bfloat16 in native:
            wanted = torch.bfloat16  # same footprint, computed in hardware here
        if wanted not in native:
            if announce:
                logger.info("dtype auto: the checkpoint is %s, which this %s computes only in emulation; running "
                            "float32", checkpoint_dtype, "CPU" if device.type == "cpu" else "GPU")
            return torch.float32
        rates = measure(hw.cpu_isa) if device.type == "cpu" and wanted == torch.bfloat16 and measure else None
        if rates is not None:  # native: is it also faster?
            if announce:
                logger.info("dtype auto: %s here (%s)", "bfloat16" if rates.bf16_pays else "float32, not the "
                            "checkpoint's bfloat16,", rates.describe())
            if not rates.bf16_pays:
                return torch.float32
        return wanted
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype '{name}'; choose auto, float32, bfloat16 or float16")
    dtype = DTYPES[name]
    if dtype not in native and announce:
        logger.warning("dtype %s: this %s has no native %s (%s); it runs correctly but emulated and slow. "
                       "float32 (or dtype auto) is much faster here", name, "CPU" if device.type == "cpu" else "GPU",
                       name, hw.describe())
    return dtype


def memory_available_bytes(device: torch.device) -> int | None:
    """Free memory for the KV cache: CUDA's free memory, or the OS's MemAvailable on CPU; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
