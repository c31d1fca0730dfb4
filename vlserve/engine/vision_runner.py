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


def groups_of(sizes: list[int], budget: int | None) -> list[list[int]]:
    """Indices in consecutive groups of at most `budget` patches (an item larger than that alone); one group if
    None."""
    if budget is None:
        return [list(range(len(sizes)))]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def batches(items: list[MultiModalItem], budget: int | None) -> list[list[MultiModalItem]]:
    return [[items[i] for i in g] for g in groups_of([it.pixel_values.shape[0] for it in items], budget)]


def cpu_budget(device: torch.device) -> int | None:
    return CPU_PATCHES_PER_CALL if device.type == "cpu" else None


class VisionRunner:
    def __init__(self, model, device: torch.device, whole_step: bool = False):
        """`model`: anything with the model's `encode_images` (a model, a `ModelShard`, the tensor-parallel
        leader). `whole_step`: one call with every item of the step (the data-parallel encoder spreads them
        over its ranks first, then each rank groups its share)."""
        self.model = model
        self.device = device
        self.whole_step = whole_step
        self.outputs: dict[str, torch.Tensor] = {}
        self.seconds: list[float] = []  # one entry per vision-tower call (histogram samples for the metrics)

    @torch.inference_mode()
    def encode(self, items: list[MultiModalItem]) -> None:
        """Batched vision-tower calls over `items` (no attention across items); outputs land in `outputs`."""
        items = [it for it in items if it.mm_hash not in self.outputs]
        budget = None if self.whole_step else cpu_budget(self.device)
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
