"""Linears that add LoRA deltas: y = base(x) + sum over adapter groups of (x_rows A^T) B^T; and the slots of
MoE expert weights, whose deltas the experts module adds.

The base linear is whatever the model runs (plain, oneDNN-packed, int8, int4): it computes the batch once, and
each adapter in the pass adds its low-rank product on its own rows (vlserve.model.layers.lora_rows), so requests
of different adapters, and of none, share one forward pass. Adapters sit in numbered slots (vlserve.lora.slots
fills them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.layers.lora_rows import active_rows


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slots: int):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapters: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots  # (A [R, in], B [out, R])

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in active_rows():
            pair = self.adapters[slot]
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                if x.dim() == 2:
                    y.addmm_(x @ a.t(), b.t())
                else:  # a tower's [items, length, width]
                    y.add_(torch.matmul(torch.matmul(x, a.t()), b.t()))
                continue
            for part in rows:  # ranges of a 2-D pass (the language model's tokens)
                y[part].addmm_(x[part] @ a.t(), b.t())
        return y

    def extra_repr(self) -> str:
        return f"slots={len(self.adapters)}"


class ExpertWeightLoRA:
    """The adapter slots of one 3-D MoE expert weight, (A [E, r, in], B [E, out, r]) each: the experts module
    adds their deltas itself (vlserve.model.layers.moe), as it runs each expert on its own tokens."""

    def __init__(self, experts: nn.Module, weight: str, slots: int):
        self.adapters: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots
        experts.lora[weight] = self.adapters


def wrap_targets(model: nn.Module, targets: dict, slots: int) -> dict[str, LoRALinear | ExpertWeightLoRA]:
    """Adapter slots on each target (vlserve.lora.adapter.lora_targets), in place: a LoRALinear around each
    linear, slots on each expert weight; returns them by name."""
    wrapped = {}
    for name, target in targets.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if target.experts:
            wrapped[name] = ExpertWeightLoRA(parent, attr, slots)
            continue
        wrapped[name] = LoRALinear(getattr(parent, attr), slots)
        setattr(parent, attr, wrapped[name])
    return wrapped
