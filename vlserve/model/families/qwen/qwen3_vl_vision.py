"""Qwen3-VL vision tower: LayerNorm + GELU(tanh) blocks with full attention per frame, a learned grid of position
embeddings resampled to each picture, and DeepStack mergers that turn chosen blocks' outputs into extra features
for the language model's first layers.

Output per merged token: `[main embedding | deepstack level 0 | level 1 | ...]`, `out_dim * (1 + levels)` wide.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.accelerator import to_device
from vlserve.model.config_types import VisionConfig
from vlserve.model.families.qwen.qwen2_vl_vision import Qwen2VLVisionBlock
from vlserve.model.layers.mlp import get_activation, in_row_slices
from vlserve.model.layers.parallel import column_linear, current_tp, even_split, row_linear
from vlserve.model.vision_common import (
    PatchEmbed,
    VisionRotary,
    VarlenPlan,
    VisionPass,
    cu_lengths,
    merge_order_hw,
)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps of target positions `index` on an axis of `size` into a `side`-long
    table: the two neighbouring table entries and their weights."""
    src = index.float() * (side - 1) / max(size - 1, 1)  # endpoints map onto the table's endpoints
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_grid_taps(grid_thw: list[tuple[int, int, int]], side: int, merge: int):
    """For every patch (processor order, all items): 4 indices into the flattened `side x side` position table
    and their bilinear weights, `[N, 4]` each. The table is stretched over each frame's (h, w) patch grid."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        rows, cols = merge_order_hw(1, h, w, merge)
        h_taps, h_w = _axis_taps(rows, h, side)
        w_taps, w_w = _axis_taps(cols, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wgt = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        indices.append(idx.repeat(t, 1))  # every frame of a video gets the same positions
        weights.append(wgt.repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


class Qwen3VisionMLP(nn.Module):
    """Qwen2-VL's vision MLP under the checkpoint names Qwen3-VL uses."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.tp = tp = current_tp()
        cols = even_split(cfg.mlp_hidden, tp, "vision MLP width")
        self.linear_fc1 = column_linear(cfg.width, {"": cols}, True)
        self.linear_fc2 = row_linear(cols, cfg.width, True, tp)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x):
        return self.tp.all_reduce(in_row_slices(lambda rows: self.linear_fc2(self.act(self.linear_fc1(rows))), x))


class Qwen3PatchMerger(nn.Module):
    """2x2 patches -> one LM-width token. The main merger normalizes each patch before concatenating; the
    DeepStack mergers (`norm_after_concat`) normalize the concatenated vector instead."""

    def __init__(self, cfg: VisionConfig, norm_after_concat: bool):
        super().__init__()
        self.hidden = cfg.width * cfg.spatial_merge_size**2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.hidden if norm_after_concat else cfg.width, eps=1e-6)
        self.tp = tp = current_tp()
        cols = even_split(self.hidden, tp, "vision merger width")
        self.linear_fc1 = column_linear(self.hidden, {"": cols}, True)
        self.act = nn.GELU()
        self.linear_fc2 = row_linear(cols, cfg.out_dim, True, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.norm_after_concat else self.norm(x).view(-1, self.hidden)
        return self.tp.all_reduce(self.linear_fc2(self.act(self.linear_fc1(x))))


class Qwen3VLVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.width)
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        self.rotary = VisionRotary(cfg)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(cfg, Qwen3VisionMLP(cfg)) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, norm_after_concat=True) for _ in cfg.side_row_layers)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [num_patches, patch_dim] -> [num_patches / merge^2, out_dim * (1 + deepstack levels)]."""
        return self.prepare(pixel_values, grid_thw).run(self.body)

    def prepare(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionPass:
        x = self.patch_embed(pixel_values)
        taps, weights = position_grid_taps(grid_thw, self.grid_side, self.cfg.spatial_merge_size)
        pos = (self.pos_embed(to_device(taps, x.device)) * to_device(weights, x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(grid_thw, x.device)
        return VisionPass(x, cos, sin, {"full": cu_lengths(grid_thw)})

    def body(self, x, cos, sin, plans: dict[str, VarlenPlan]) -> torch.Tensor:
        deepstack = []  # in block order, each from the merger listed at its index's position
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plans["full"])
            if i in self.cfg.side_row_layers:
                deepstack.append(self.deepstack_merger_list[self.cfg.side_row_layers.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
