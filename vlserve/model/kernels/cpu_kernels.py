"""vlserve's own CPU kernels (csrc/), compiled once per machine with torch.utils.cpp_extension.

`make install` builds them (`python -m vlserve.model.kernels.cpu_kernels`); a process that finds no build
compiles on first use. Where no compiler works, `load()` returns None once, logs why, and callers use their torch
fallbacks. The kernel ISA follows vlserve.model.hardware (so VLSERVE_CPU_ISA caps it too).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from vlserve.model.hardware import ISA_ORDER, detect

logger = logging.getLogger("vlserve.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCES = ["ops.cpp", "kernels_avx512bf16.cpp", "kernels_avx512.cpp", "kernels_avx2.cpp", "kernels_generic.cpp"]
DISABLE_ENV = "VLSERVE_CPU_KERNELS"  # "0" turns them off (torch fallbacks everywhere)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the attention, norm and rotary kernels take


def build_dir() -> Path:
    root = os.environ.get("VLSERVE_KERNEL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = Path(root) / "vlserve" / f"cpu-kernels-torch{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module, or None when kernels are disabled or cannot be built here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        if shutil.which("ninja") is None:  # the pip package's binary, when the venv's bin is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        flags = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"]  # no FMA the reference does not do
        return load_extension("vlserve_cpu_kernels", [str(CSRC / s) for s in SOURCES], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir()), verbose=False)
    except Exception as e:  # no compiler, no headers, read-only cache: the torch paths still work
        logger.warning("vlserve CPU kernels unavailable (%s: %s); using slower torch fallbacks", type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "")
        return None


def isa_cap() -> int:
    """0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 with bf16 dot products: what hardware.detect() allows (after
    VLSERVE_CPU_ISA)."""
    level = ISA_ORDER.index(detect().cpu_isa)
    for cap, name in ((3, "avx512_bf16"), (2, "avx512"), (1, "avx2")):
        if level >= ISA_ORDER.index(name):
            return cap
    return 0


def for_tensor(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES):
    """The compiled module when it can take `x` (a CPU tensor of one of `dtypes`), else None: the one check every
    caller makes before choosing between a kernel and its torch fallback."""
    if x.device.type != "cpu" or x.dtype not in dtypes:
        return None
    return load()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    module = load()
    print(f"vlserve CPU kernels: {'built' if module else 'NOT available'} in {build_dir()}"
          + (f" (best ISA here: {module.cpu_isa()})" if module else ""))
