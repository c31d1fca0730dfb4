"""Qwen2-VL vision tower: LayerNorm + GELU-MLP blocks with full attention per image (per frame)."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.config_types import VisionConfig
from vlserve.model.layers.mlp import get_activation, in_row_slices
from vlserve.model.layers.parallel import column_linear, current_tp, even_split, row_linear
from vlserve.model.vision_common import (
    PatchEmbed,
    PatchMerger,
    VarlenPlan,
    VisionAttention,
    VisionPass,
    VisionRotary,
    cu_lengths,
)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.tp = tp = current_tp()
        cols = even_split(cfg.mlp_hidden, tp, "vision MLP width")
        self.fc1 = column_linear(cfg.width, {"": cols}, True)
        self.fc2 = row_linear(cols, cfg.width, True, tp)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x):
        return self.tp.all_reduce(in_row_slices(lambda rows: self.fc2(self.act(self.fc1(rows))), x))


class Qwen2VLVisionBlock(nn.Module):
    """Pre-norm attention + MLP block. Qwen2-VL: LayerNorm and a GELU MLP; Qwen2.5-VL and Qwen3-VL pass their own
    norm and MLP."""

    def __init__(self, cfg: VisionConfig, mlp: nn.Module | None = None, norm: type[nn.Module] = nn.LayerNorm):
        super().__init__()
        self.norm1 = norm(cfg.width, eps=1e-6)
        self.norm2 = norm(cfg.width, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp if mlp is not None else VisionMLP(cfg)

    def forward(self, x, cos, sin, plan: VarlenPlan):
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class Qwen2VLVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotary(cfg)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, nn.LayerNorm(cfg.width, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [num_patches, patch_dim] for all items -> [num_patches / merge^2, out_dim]."""
        return self.prepare(pixel_values, grid_thw).run(self.body)

    def prepare(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionPass:
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid_thw, x.device)
        return VisionPass(x, cos, sin, {"full": cu_lengths(grid_thw)})

    def body(self, x, cos, sin, plans: dict[str, VarlenPlan]) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cos, sin, plans["full"])
        return self.merger(x)
