"""Runs the vision tower over media items, many at once, and keeps each output by mm_hash until told to drop it.

Which items to encode and which outputs may go is decided elsewhere (the scheduler's, or an encode service's,
`EncoderCacheManager`); this only computes and stores. Used by the engine's model runner and by the
disaggregated encode service alike.
"""

from __future__ import annotations

import time

import torch

from vlserve.core.prompt import MultiModalItem

# On CPU the tower runs faster on a few thousand patches at a time than on everything at once: activations of a
# large batch ([patches, 4 x width] per block) fall out of the caches (16 pictures in one call: ~25% slower per
# patch than in groups). GPUs want the big batch.
CPU_PATCHES_PER_CALL = 2048


def batches(items: list[MultiModalItem], budget: int | None) -> list[list[MultiModalItem]]:
    """Consecutive groups of at most `budget` patches (an item larger than that alone); one group if None."""
    if budget is None:
        return [items]
    groups: list[list[MultiModalItem]] = [[]]
    used = 0
    for it in items:
        n = it.pixel_values.shape[0]
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(it)
        used += n
    return groups


class VisionRunner:
    def __init__(self, model, device: torch.device, ranks: int = 1):
        """`model`: anything with the model's `encode_images` (a model, a `ModelShard`, the tensor-parallel
        leader). `ranks`: ranks that share each call (the data-parallel encoder), so each still gets a CPU-sized
        group of patches."""
        self.model = model
        self.device = device
        self.ranks = ranks
        self.outputs: dict[str, torch.Tensor] = {}
        self.seconds: list[float] = []  # one entry per vision-tower call (histogram samples for the metrics)

    @torch.inference_mode()
    def encode(self, items: list[MultiModalItem]) -> None:
        """Batched vision-tower calls over `items` (no attention across items); outputs land in `outputs`."""
        items = [it for it in items if it.mm_hash not in self.outputs]
        budget = CPU_PATCHES_PER_CALL * self.ranks if self.device.type == "cpu" else None
        for group in batches(items, budget) if items else []:
            t0 = time.perf_counter()
            pixels = torch.cat([it.pixel_values for it in group]).to(self.device, non_blocking=True)
            embeds = self.model.encode_images(pixels, [it.grid_thw for it in group])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # so the latency below is the encoder's, not the launch's
            self.seconds.append(time.perf_counter() - t0)
            for it, emb in zip(group, embeds):
                self.outputs[it.mm_hash] = emb

    def free(self, keys: list[str]) -> None:
        for key in keys:
            self.outputs.pop(key, None)

    def take_seconds(self) -> list[float]:
        seconds, self.seconds = self.seconds, []
        return seconds
