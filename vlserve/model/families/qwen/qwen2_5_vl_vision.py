"""Qwen2.5-VL vision tower: RMSNorm + SwiGLU blocks; most blocks attend inside local windows, a few globally.

Window attention needs the tokens of a window to be contiguous, so patches are reordered window by window
(in units of one merge group, so the merger still sees its 2x2 groups together) before the blocks, and the
merged output is put back in the processor's order at the end.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.accelerator import to_device
from vlserve.model.config_types import VisionConfig
from vlserve.model.families.qwen.qwen2_vl_vision import Qwen2VLVisionBlock
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.vision_common import (
    PatchEmbed,
    PatchMerger,
    VisionRotary,
    VarlenPlan,
    VisionPass,
    cu_lengths,
)


def window_order(grid_thw: list[tuple[int, int, int]], cfg: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """Merge-group order that makes every window contiguous, and the token count of each window."""
    merge = cfg.spatial_merge_size
    win = cfg.window_size // merge // cfg.patch_size  # window side, in merged tokens
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for r0 in range(0, gh, win):
                for c0 in range(0, gw, win):
                    cell = idx[frame, r0 : r0 + win, c0 : c0 + win].reshape(-1)
                    order.append(cell + base)
                    lengths.append(cell.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), lengths


class Qwen2_5_VLVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotary(cfg)
        self.blocks = nn.ModuleList(
            Qwen2VLVisionBlock(cfg, GatedMLP(cfg.width, cfg.mlp_hidden, cfg.hidden_act, bias=True), RMSNorm)
            for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, RMSNorm(cfg.width, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.prepare(pixel_values, grid_thw).run(self.body)

    def prepare(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionPass:
        unit = self.cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid_thw, x.device)
        order, window_lengths = window_order(grid_thw, self.cfg)
        order = to_device(order, x.device)

        def regroup(t: torch.Tensor) -> torch.Tensor:  # reorder whole merge groups into window order
            return t.view(-1, unit, t.shape[-1])[order].reshape(-1, t.shape[-1])

        # windows never cross frames: the per-frame sequences still hold in window order
        return VisionPass(regroup(x), regroup(cos), regroup(sin),
                          {"full": cu_lengths(grid_thw), "window": window_lengths},
                          finish=lambda merged: merged[torch.argsort(order)])

    def body(self, x, cos, sin, plans: dict[str, VarlenPlan]) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plans["full"] if i in self.cfg.fullatt_block_indexes else plans["window"])
        return self.merger(x)
