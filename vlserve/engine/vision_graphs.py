"""The vision tower's blocks and mergers replayed from graphs captured per patch-count bucket (CUDA graphs; on a
CPU the same path replays eagerly, which is how it is tested).

A tower that splits its call into `prepare` and `body` (vlserve.model.vision_common.VisionPass) qualifies. For a
call of N patches the smallest bucket >= N is used, captured the first time it is needed: the N real rows are
copied into the bucket's static buffers and the rows past N form one extra attention sequence of their own, so
no real patch attends to them. Each plan's sequence starts live in a static buffer long enough for any call of
that many patches (every sequence, a frame or a window, holds at least one merge group). The body's merged rows
past N / merge^2 are padding and dropped.

Only the varlen attention path (Triton) can be captured: its sequence layout is a device tensor. Calls larger
than the largest bucket run op by op.
"""

from __future__ import annotations

import torch

from vlserve.engine.decode_graphs import padded_size
from vlserve.model.accelerator import TRITON, Accelerator, to_device
from vlserve.model.vision_common import VarlenPlan, VisionPass

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)  # patches; larger calls are compute-bound anyway


def supports_graphs(tower: torch.nn.Module | None, acc: Accelerator) -> bool:
    return tower is not None and hasattr(tower, "prepare") and hasattr(tower, "body") and acc.attention == TRITON


class _Bucket:
    """Static buffers and the graph of one patch count."""

    def __init__(self, tower, acc: Accelerator, size: int, plan_names: tuple[str, ...], unit: int,
                 x: torch.Tensor, cos: torch.Tensor):
        dev = acc.device
        self.size = size
        self.x = x.new_zeros(size, x.shape[1])
        self.cos = cos.new_ones(size, cos.shape[1])
        self.sin = cos.new_zeros(size, cos.shape[1])
        self.max_seqs = size // unit + 1  # every real sequence holds >= one merge group; + the padding one
        self.starts = {name: torch.full((self.max_seqs + 1,), size, dtype=torch.long, device=dev)
                       for name in plan_names}
        self.plans = {name: VarlenPlan([], cu_seqlens=starts, max_len=size) for name, starts in self.starts.items()}
        for starts in self.starts.values():
            starts[0] = 0
        self.out: torch.Tensor | None = None  # the body's rows, in a buffer every replay overwrites

        def run() -> None:
            for plan in self.plans.values():  # work lists follow the sequence starts: built again in every run
                plan.work.clear()
            rows = tower.body(self.x, self.cos, self.sin, self.plans)
            if self.out is None:  # the first run (a CUDA capture's warm-up): outside any capture
                self.out = torch.empty_like(rows)
            self.out.copy_(rows)

        self.graph = acc.capture(run)


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, acc: Accelerator, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        self.tower, self.acc = tower, acc
        self.unit = tower.cfg.spatial_merge_size ** 2
        self.buckets = tuple(sorted(b for b in buckets if b % self.unit == 0))
        self.captured: dict[tuple[int, tuple[str, ...]], _Bucket] = {}
        self.replays = 0

    def __call__(self, pixel_values: torch.Tensor, layouts: list[tuple[int, int, int]]) -> torch.Tensor:
        """What `tower(pixel_values, layouts)` returns."""
        vp: VisionPass = self.tower.prepare(pixel_values, layouts)
        n = vp.x.shape[0]
        size = padded_size(self.buckets, n)
        if size is None:
            return vp.run(self.tower.body)
        key = (size, tuple(sorted(vp.lengths)))
        bucket = self.captured.get(key)
        if bucket is None:
            bucket = self.captured[key] = _Bucket(self.tower, self.acc, size, key[1], self.unit, vp.x, vp.cos)
        self._stage(bucket, vp, n)
        bucket.graph.replay()
        self.replays += 1
        # A copy: the encoder cache keeps these rows across steps, and the bucket's next replay overwrites its buffer.
        merged = bucket.out[: n // self.unit].clone()
        return merged if vp.finish is None else vp.finish(merged)

    def _stage(self, bucket: _Bucket, vp: VisionPass, n: int) -> None:
        bucket.x[:n].copy_(vp.x)
        bucket.x[n:].zero_()
        bucket.cos[:n].copy_(vp.cos)
        bucket.cos[n:].fill_(1)
        bucket.sin[:n].copy_(vp.sin)
        bucket.sin[n:].zero_()
        for name, lengths in vp.lengths.items():
            # A fresh host tensor each call (pinned on its way: a reused buffer could be overwritten before its
            # copy ran, since nothing waits for this call's work before the next call).
            host = torch.full((bucket.max_seqs + 1,), bucket.size, dtype=torch.long)  # padding, then empty ones
            host[0] = 0
            host[1 : len(lengths) + 1] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
            bucket.starts[name].copy_(to_device(host, bucket.starts[name].device))
