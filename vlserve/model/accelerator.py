"""What differs between a CPU and a CUDA device, in one place: which attention path runs, host staging memory,
graph capture and waiting for the device.

Everything CUDA-only (graph capture, pinned memory, the side stream of a capture) is behind `Accelerator`; the
bookkeeping around it (static buffers, padding, bucketing) is ordinary tensor code that runs on both, so it is
tested on the CPU. There a "graph" is `EagerGraph`: replaying it runs the captured function again over the same
static buffers, which is exactly what a CUDA graph's replay computes.

Attention: on CUDA the varlen Triton kernel (vlserve.model.kernels.triton_attention); on CPU vlserve's CPU kernels
or torch SDPA. `VLSERVE_ATTENTION=triton` forces the Triton path anywhere (on a CPU it runs in Triton's
interpreter: tests of the CUDA path's logic only); `VLSERVE_ATTENTION=native` forces the CPU/SDPA path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.model.kernels import triton_kernels

logger = logging.getLogger("vlserve.accelerator")
ATTENTION_ENV = "VLSERVE_ATTENTION"
TRITON, NATIVE = "triton", "native"


def triton_available() -> bool:
    """Triton is installed and imports. Asked only where Triton would run (CUDA, or forced): importing it takes
    ~0.3 s that a CPU engine never needs."""
    return importlib.util.find_spec("triton") is not None and triton_kernels().available()


def attention_backend(device: torch.device | str) -> str:
    """"triton" (the varlen kernel, one launch a step) or "native" (CPU kernels / SDPA, per sequence)."""
    forced = os.environ.get(ATTENTION_ENV, "").strip().lower()
    if forced:
        if forced not in (TRITON, NATIVE):
            raise InvalidInputError(f"{ATTENTION_ENV}={forced!r}: expected {TRITON!r} or {NATIVE!r}")
        if forced == TRITON and not triton_available():
            raise InvalidInputError(f"{ATTENTION_ENV}=triton, but Triton is not installed")
        return forced
    if torch.device(device).type == "cuda" and triton_available():
        return TRITON
    return NATIVE


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (in `dtype`) without making the host wait. A copy from ordinary (pageable) host memory to a
    GPU first waits for everything already queued there, which would end any overlap of host work with the
    device's: host tensors go through pinned memory and copy without blocking."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype) if dtype is not None else t.to(device)


class Timer:
    """Device time of the work queued between `start()` and `stop()`: CUDA events on a GPU (`seconds()` is None
    until that work is done, and never waits for it), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> Timer:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def stop(self) -> Timer:
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = time.perf_counter() - self.t0
        return self

    def seconds(self) -> float | None:
        if not self.cuda:
            return self.elapsed
        return self.begin.elapsed_time(self.end) / 1e3 if self.end.query() else None


class EagerGraph:
    """The CPU's stand-in for a captured graph: `replay` calls the function again (on the same static buffers)."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        fn()  # as a capture does: the function runs once now

    def replay(self) -> None:
        self.fn()


class CudaGraph:
    """A CUDA graph of `fn`, warmed up on a side stream first (lazy initialisations must not be captured)."""

    def __init__(self, fn: Callable[[], None], pool, warmups: int = 2):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Accelerator:
    """The device-specific calls the engine makes; one per model shard."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # streams, events, graphs and Triton launches follow the current one
        if self.is_cuda:
            # float32 stays IEEE float32, as cuBLAS and the Triton kernel keep it: cuDNN would round the audio
            # towers' convolutions through TF32 (8e-4 off transformers' features on an H200). bf16/fp16: no effect.
            torch.backends.cudnn.allow_tf32 = False
        self.attention = attention_backend(self.device)
        self._pool = None

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to fill on the CPU and copy to the device without blocking (pinned on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def to_device(self, host: torch.Tensor, static: torch.Tensor) -> None:
        """Copies `host` (a staging buffer's prefix) into the start of the static device buffer `static`."""
        static[: host.shape[0]].copy_(host, non_blocking=self.is_cuda)

    def capture(self, fn: Callable[[], None]) -> EagerGraph | CudaGraph:
        """`fn` as a graph: its replays recompute it over the same buffers. All graphs of one accelerator share
        one memory pool (they never run at once)."""
        if not self.is_cuda:
            return EagerGraph(fn)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return CudaGraph(fn, self._pool)

    def event(self) -> torch.cuda.Event | NoEvent:
        """Marks a point in the device's queue (`record()`), so the host can wait until the work before it is done
        (`synchronize()`); on a CPU every call already ran."""
        return torch.cuda.Event() if self.is_cuda else NoEvent()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
