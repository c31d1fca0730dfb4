"""Runs the media encoders (the vision tower, the audio tower) over media items, many at once, and keeps each
output by mm_hash until told to drop it.

Which items to encode and which outputs may go is decided elsewhere (the scheduler's, or an encode service's,
`EncoderCacheManager`); this only computes and stores. Used by the engine's model runner and by the
disaggregated encode service alike.
"""

from __future__ import annotations

import torch

from vlserve.core.prompt import MultiModalItem
from vlserve.model.layers.lora_rows import lora_rows
from vlserve.model.accelerator import Timer, to_device

# On CPU the tower runs faster on a few thousand patches at a time than on everything at once: activations of a
# large batch ([patches, 4 x width] per block) fall out of the caches (16 pictures in one call: ~25% slower per
# patch than in groups). GPUs want the big batch.
CPU_PATCHES_PER_CALL = 2048
# Audio: frames of log-mel features per call on CPU (two 30 s clips); the tower's activations are [frames / 2,
# width] per layer, so this bounds them as the patch budget bounds the ViT's.
CPU_AUDIO_FRAMES_PER_CALL = 6000


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


def batches(items: list[MultiModalItem], budget: int | None, audio: bool = False) -> list[list[MultiModalItem]]:
    """`items` in tower calls of at most `budget` patches (pictures) or feature frames (`audio`)."""
    sizes = [it.audio_features.shape[1] if audio else it.pixel_values.shape[0] for it in items]
    return [[items[i] for i in g] for g in groups_of(sizes, budget)]


def cpu_budget(device: torch.device) -> int | None:
    return CPU_PATCHES_PER_CALL if device.type == "cpu" else None


class EncoderRunner:
    def __init__(self, model, device: torch.device, whole_step: bool = False):
        """`model`: anything with the model's `encode_images` / `encode_audio` (a model, a `ModelShard`, the
        tensor-parallel leader). `whole_step`: one vision call with every picture of the step (the data-parallel
        encoder spreads them over its ranks first, then each rank groups its share)."""
        self.model = model
        self.device = device
        self.whole_step = whole_step
        self.outputs: dict[str, torch.Tensor] = {}
        self.timers: list[tuple[str, Timer]] = []  # (tower, its timer) per tower call: histogram samples

    @torch.inference_mode()
    def encode(self, items: list[MultiModalItem], lora_slots: list[int | None] | None = None) -> None:
        """Batched tower calls over `items` (no attention across items); outputs land in `outputs`. `lora_slots`:
        per item, the adapter slot its tower runs with (None: none); items of one adapter share calls."""
        slots = lora_slots or [None] * len(items)
        todo: dict[int | None, list[MultiModalItem]] = {}
        for it, slot in zip(items, slots):
            if it.mm_hash not in self.outputs:
                todo.setdefault(slot, []).append(it)
        for slot, group in todo.items():
            with lora_rows(() if slot is None else ((slot, None),)):
                self._encode(group)

    def _encode(self, items: list[MultiModalItem]) -> None:
        pictures = [it for it in items if it.pixel_values is not None]
        sounds = [it for it in items if it.audio_features is not None]
        budget = None if self.whole_step else cpu_budget(self.device)
        for group in batches(pictures, budget) if pictures else []:
            pixels = to_device(torch.cat([it.pixel_values for it in group]), self.device)
            self._timed("vision", group, lambda: self.model.encode_images(pixels, [it.layout for it in group]))
        audio_budget = CPU_AUDIO_FRAMES_PER_CALL if self.device.type == "cpu" else None
        for group in batches(sounds, audio_budget, audio=True) if sounds else []:
            features = [to_device(it.audio_features, self.device) for it in group]
            self._timed("audio", group, lambda: self.model.encode_audio(features, [it.audio_len for it in group]))

    def _timed(self, tower: str, group: list[MultiModalItem], call) -> None:
        timer = Timer(self.device).start()
        embeds = call()
        self.timers.append((tower, timer.stop()))  # the tower's own time, read once the device has run it
        for it, emb in zip(group, embeds):
            self.outputs[it.mm_hash] = emb

    def free(self, keys: list[str]) -> None:
        for key in keys:
            self.outputs.pop(key, None)

    def take_seconds(self) -> list[tuple[str, float]]:
        """Durations of the tower calls the device has finished since the last call (others wait their turn)."""
        seconds, waiting = [], []
        for tower, timer in self.timers:
            s = timer.seconds()
            if s is None:
                waiting.append((tower, timer))
            else:
                seconds.append((tower, s))
        self.timers = waiting
        return seconds
