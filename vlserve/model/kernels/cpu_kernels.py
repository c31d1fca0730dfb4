"""vlserve's own CPU kernels (csrc/), compiled once per machine with torch.utils.cpp_extension.

`make install` builds them (`python -m vlserve.model.kernels.cpu_kernels`); a server or an `LLM` only loads a
finished build and never compiles (without one it logs how to build it and uses its torch fallbacks).

A build lives in a cache folder named by a hash of what makes it: the sources, the flags, the compiler, torch and
Python. Two checkouts with the same sources share one build; a checkout with other sources (another branch, an
upgrade) gets its own folder and never invalidates anyone's. A build is compiled in a private temporary folder
under an OS file lock (`flock`: released when its holder dies, so a killed build never leaves a lock anyone waits
on) and moved into place in one rename, so nobody ever sees half a build. A finished build is readable by every
user (a container builds it as root and serves as another uid); a cache this process cannot read or write is a
warning and the torch fallbacks, never an error. The kernel ISA follows vlserve.model.hardware (so
VLSERVE_CPU_ISA caps it too).

The cache folder: $VLSERVE_KERNEL_CACHE when set (that folder itself holds the `cpu-kernels-<key>` builds), else
$XDG_CACHE_HOME/vlserve, else ~/.cache/vlserve. (Versions before this one added a `vlserve/` level below
$VLSERVE_KERNEL_CACHE; such a folder is left alone and may be deleted.)
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vlserve.model.hardware import ISA_ORDER, detect

logger = logging.getLogger("vlserve.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "int8_dot.cpp", "kernels_int8_dot.cpp", "kernels_avx512bf16.cpp", "kernels_avx512.cpp",
           "kernels_avx2.cpp", "kernels_generic.cpp")
NAME = "vlserve_cpu_kernels"
LIBRARY = NAME + ".so"
CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off")  # no FMA the reference does not do
LDFLAGS = ("-fopenmp",)
DISABLE_ENV = "VLSERVE_CPU_KERNELS"  # "0" turns them off (torch fallbacks everywhere)
CACHE_ENV = "VLSERVE_KERNEL_CACHE"  # the folder that holds the builds (default: ~/.cache/vlserve)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the attention, norm and rotary kernels take
BUILD_COMMAND = f"{Path(sys.executable).name} -m vlserve.model.kernels.cpu_kernels"
_built: dict[Path, object] = {}  # modules this process compiled (imported once, from their build folder)


def cache_root() -> Path:
    """The folder that holds the builds: $VLSERVE_KERNEL_CACHE exactly as given, else $XDG_CACHE_HOME/vlserve (by
    default ~/.cache/vlserve)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return user_cache_dir()


def user_cache_dir() -> Path:
    """This user's vlserve cache folder: $XDG_CACHE_HOME/vlserve, else ~/.cache/vlserve."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlserve"


def _unusable_cache(folder: Path, e: OSError) -> None:
    logger.warning("vlserve CPU kernels: the kernel cache %s cannot be read by this user (uid %d: %s: %s); using "
                   "the slower torch paths. Make it readable (chmod -R a+rX %s) or point %s at a folder this user "
                   "can read, and build there with `%s`", folder, os.getuid(), type(e).__name__, e, cache_root(),
                   CACHE_ENV, BUILD_COMMAND)


@functools.lru_cache(maxsize=None)
def _compiler_identity() -> str:
    """The C++ compiler torch's extension builder will call, and its version."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or cxx
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{os.path.realpath(path)}|{out.splitlines()[0] if out else 'unknown'}"


def build_key(csrc: Path = CSRC, compiler: str | None = None) -> str:
    """Hash of everything that makes the build: every source and header, flags, compiler, torch, Python."""
    h = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (CFLAGS, LDFLAGS, SOURCES, compiler or _compiler_identity(), torch.__version__,
                 torch.version.git_version, torch._C._GLIBCXX_USE_CXX11_ABI, sys.implementation.cache_tag,
                 platform.machine()):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()[:16]


def library_dir() -> Path:
    return cache_root() / f"cpu-kernels-{build_key()}"


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module when kernels are on and this checkout's build exists, else None (logged once, with the
    command that builds them). Never compiles: a server's start or first request must not wait for a compiler."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    folder = library_dir()
    try:
        built = (folder / LIBRARY).is_file()
    except OSError as e:  # a folder another user built, private to them (root's build, served as uid 10001)
        _unusable_cache(folder, e)
        return None
    if not built:
        logger.warning("vlserve CPU kernels are not built for these sources, this compiler and torch (%s): using "
                       "the slower torch paths. Build them once with `%s` (about a minute on 2 cores; `make "
                       "install` does it)", folder, BUILD_COMMAND)
        return None
    try:
        module = _import(folder)
    except PermissionError as e:  # the library itself is private to the user who built it
        _unusable_cache(folder, e)
        return None
    except Exception as e:  # noqa: BLE001 - a broken build must not stop the engine: the torch paths still work
        logger.warning("vlserve CPU kernels in %s could not be loaded (%s: %s); using slower torch fallbacks. "
                       "Rebuild: rm -r %s && %s", folder, type(e).__name__, e, folder, BUILD_COMMAND)
        return None
    logger.info("vlserve CPU kernels loaded from %s", folder)
    return module


def _import(folder: Path):
    if folder in _built:
        return _built[folder]
    spec = importlib.util.spec_from_file_location(NAME, folder / LIBRARY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _built[folder] = module
    return module


def build(folder: Path | None = None, compile_into=None) -> Path | None:
    """Compiles the kernels into `folder` (default: this checkout's `library_dir()`) unless a build is already
    there; returns the folder, or None when they cannot be built here (no compiler, no headers: logged).

    Builders of the same folder take turns under an OS lock; each compiles in its own temporary folder, which a
    rename puts in place. `compile_into(tmp_folder)` does the compiling (tests replace it)."""
    folder = folder or library_dir()
    compile_into = compile_into or _compile
    module = None
    try:
        if (folder / LIBRARY).is_file():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{folder.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another builder of this folder finishes first (or dies)
            if (folder / LIBRARY).is_file():
                return folder
            for stale in folder.parent.glob(f"{folder.name}.build-*"):  # left by builders that were killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.build-", dir=folder.parent))
            try:
                logger.info("compiling vlserve CPU kernels into %s (about a minute on 2 cores)", folder)
                module = compile_into(tmp)
                if not (tmp / LIBRARY).is_file():
                    raise RuntimeError(f"the build left no {LIBRARY}")
                # mkdtemp made it 0700: as a plain mkdir would (umask), so that other users can load it
                os.chmod(tmp, 0o777 & ~_umask())
                os.rename(tmp, folder)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if module is not None:
            _built[folder] = module
        load.cache_clear()
        return folder
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, read-only cache: the torch paths still work
        hint = (f" (the kernel cache {folder.parent} is not writable by this user: set {CACHE_ENV} to a folder that "
                "is)") if isinstance(e, PermissionError) else ""
        logger.warning("vlserve CPU kernels cannot be built here (%s: %s)%s; using slower torch fallbacks",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "", hint)
        return None


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads' file creation)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def _compile(into: Path):
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the pip package's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # (copies: the builder appends to the lists it is given, which would change the build key)
    return load_extension(NAME, [str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                          extra_ldflags=list(LDFLAGS), build_directory=str(into), verbose=False)


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
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build()
    module = load() if built else None
    print(f"vlserve CPU kernels: {'built' if module else 'NOT available'} in {built or library_dir()}"
          + (f" (best ISA here: {module.cpu_isa()})" if module else ""))
    sys.exit(0 if module else 1)
