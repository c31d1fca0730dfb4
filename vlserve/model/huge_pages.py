"""A model's CPU tensors and KV cache in 2 MiB pages (Linux transparent huge pages), asked for with madvise.

Batch-1 decode streams every weight once a token. With 4 KiB pages that is a TLB miss every 4 KiB, and in a
virtual machine (nested page tables) each miss walks two sets of tables; in 2 MiB pages the weights of a
layer need a handful of entries. Measured on a 2-core Intel VM (medium random Qwen2-VL, one process switching
the same tensors between the two kinds of pages: benchmarks/huge_pages.py): int8 decode 1.13x faster; fp32
decode, whose GEMV torch runs at the memory's rate either way, unchanged.

Where the kernel allows it (`enabled` is "always" or "madvise": most distributions' default is madvise, under
which glibc's and torch's allocations get none), one anonymous mapping is made per call, aligned to 2 MiB and
advised MADV_HUGEPAGE; the kernel backs it with huge pages where it can, else with small ones (nothing fails).
Elsewhere (no THP, not Linux, VLSERVE_HUGE_PAGES=0) tensors stay where they are.

The arena is one storage, alive while any tensor on it is: a weight replaced after the move (oneDNN packing,
MoE experts packed) would keep its bytes there, so the engine moves its model last (engine.model_shard).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "VLSERVE_HUGE_PAGES"  # "0": keep tensors where torch put them


def available() -> bool:
    """Transparent huge pages can be asked for here."""
    if os.environ.get(ENV, "1") == "0" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def arena(nbytes: int) -> torch.Tensor:
    """`nbytes` zeroed bytes (uint8) in a mapping advised for huge pages; it lives as long as the tensor (and any
    view of it) does."""
    size = -(-(nbytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to align the start
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    skip = -base % HUGE_PAGE
    advised = ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(base + skip),
                                                        ctypes.c_size_t(size - skip), MADV_HUGEPAGE)
    if advised != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    # frombuffer keeps `region` alive (the tensor holds its buffer); the mapping goes with the last view
    return torch.frombuffer(region, dtype=torch.uint8)[skip:skip + nbytes]


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed tensors of `shapes` in one arena. Written once here, as torch.zeros would: a fresh mapping reads as
    zeros already, but its memory would only be taken as it is first written, so a machine short of it would fail
    a request later rather than the start now."""
    elem = torch.empty(0, dtype=dtype).element_size()
    sizes = [-(-torch.Size(s).numel() * elem // ALIGN) * ALIGN for s in shapes]
    whole = arena(sum(sizes)).zero_()
    out, at = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(whole[at:at + torch.Size(shape).numel() * elem].view(dtype).view(shape))
        at += size
    return out


def _module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every plain CPU tensor the modules hold: parameters, buffers and tensor attributes (views made at load);
    not those of another layout (oneDNN-packed weights own their memory)."""
    seen, out = set(), []
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *module.__dict__.values()):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided \
                    and not t.is_mkldnn and not t.is_quantized and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


@torch.no_grad()
def move_model(model: nn.Module) -> int:
    """Moves the storage of each of `model`'s CPU tensors into one huge-page arena, in place (every tensor keeps
    its identity, dtype, shape, strides and sharing: tied or packed weights stay one storage). Returns the bytes
    moved (0 where huge pages are not available)."""
    if not available():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # storage -> the tensors on it
    for t in _module_tensors(model):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {ptr: -(-ts[0].untyped_storage().nbytes() // ALIGN) * ALIGN for ptr, ts in groups.items()}
    total = sum(sizes.values())
    if total < HUGE_PAGE:
        return 0
    whole = arena(total)
    store, pos = whole.untyped_storage(), 0
    for ptr, ts in groups.items():
        # One storage at a time, its tensors switched before the next is copied: each old storage is freed
        # as soon as it is copied, so the peak is the model plus one storage, not twice the model.
        old = ts[0].untyped_storage()
        whole[pos:pos + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        del old
        at = whole.storage_offset() + pos  # bytes into `store`: a cache line's multiple, so any element size's
        for t in ts:
            t.set_(store, at // t.element_size() + t.storage_offset(), t.shape, t.stride())
        pos += sizes[ptr]
    _return_freed_memory()
    return total


def _return_freed_memory() -> None:
    """The old storages below glibc's mmap threshold were freed into its heap, which keeps them (RSS 245 MB over
    the model for the medium int8 one): malloc_trim gives the free pages back. Nothing where the C library has
    no malloc_trim (not glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
