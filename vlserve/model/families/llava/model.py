"""The LLaVA model: a vision encoder (vision.py), a 2-layer projector to the LM width, the picture packing
(anyres tiles laid out, unpadded, OneVision's anyres_max downscale, image_newline rows) and video pooling, then
a Qwen2 (LLaVA-OneVision) or Llama (LLaVA-NeXT-Video) decoder with 1-D RoPE.

`LlavaTower` is the `visual` of a `VisionLanguageModel`: forward(pixel_values [tiles, C*S*S], grids) returns every
item's embedding rows one after another (counts: anyres.py). Its parameter names follow the checkpoint's
(`vision_tower.*`, `multi_modal_projector.*`, `image_newline`: weights.py). It is built whole on every
tensor-parallel rank (small beside the LM), so it needs no collective.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.model.config_types import ModelConfig, TextConfig
from vlserve.model.decoder import DecoderLayer, DecoderModel
from vlserve.model.families.llava import anyres
from vlserve.model.families.llava.checks import item_pixel_rows, item_tokens
from vlserve.model.families.llava.config import (
    FEATURE_LAYERS,
    FEATURE_SELECT,
    MLP_BIAS,
    PROJECTOR_ACT,
    PROJECTOR_BIAS,
    TEXT_MODEL,
    VISION_EPS,
    VISION_MODEL,
)
from vlserve.model.families.llava.vision import VisionEncoder
from vlserve.model.layers.mlp import GatedMLP, get_activation
from vlserve.model.layers.parallel import SINGLE, building_for
from vlserve.model.qwen2_text import Qwen2Attention, Qwen2TextModel
from vlserve.model.vl_model import VisionLanguageModel


class Projector(nn.Module):
    """linear_1 -> act -> linear_2: vision features (width x feature layers) to the LM width."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaTower(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.geo = anyres.Geometry.of(cfg)
        layers = tuple(cfg.setting(FEATURE_LAYERS))
        self.drop_cls = cfg.setting(FEATURE_SELECT) == "default"  # CLIP's class row (config.py allows no other)
        self.vision_tower = VisionEncoder(v, cfg.setting(VISION_MODEL), self.geo.image_size,
                                          float(cfg.setting(VISION_EPS)), layers)
        self.multi_modal_projector = Projector(v.width * len(layers), cfg.text.hidden_size,
                                               cfg.setting(PROJECTOR_ACT), bool(cfg.setting(PROJECTOR_BIAS)))
        self.image_newline = nn.Parameter(torch.empty(cfg.text.hidden_size))

    @property
    def patch_embed(self) -> nn.Module:
        """The first layer (whose weight dtype the engine reads as the tower's)."""
        return self.vision_tower.patch_embed

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [tiles or frames of all items, C*S*S] -> [rows of all items, hidden]."""
        feats = self.vision_tower(pixel_values)  # [N, rows, width * layers]
        if self.drop_cls:
            feats = feats[:, 1:]
        out, start = [], 0
        for t, h, w in grids:
            item = feats[start : start + t]  # [t, n*n, width * layers]
            start += t
            out.append(self.video(item) if (h, w) == (0, 0) else self.picture(self.multi_modal_projector(item), h, w))
        return torch.cat(out)

    def picture(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """tiles [1 + rows*cols (or 1), n*n, hidden] of a height x width picture -> [image rows, hidden]: the
        base tile, then the anyres grid row by row, each row closed by image_newline."""
        base = tiles[0]
        newline = self.image_newline.to(tiles.dtype)
        if tiles.shape[0] == 1:  # the base tile only
            return torch.cat([base, newline[None]])
        n, hidden = self.geo.side, tiles.shape[-1]
        rows, cols = self.geo.tile_grid(height, width)
        grid = tiles[1:].view(rows, cols, n, n, hidden).permute(4, 0, 2, 1, 3).reshape(hidden, rows * n, cols * n)
        keep_h, keep_w = anyres.unpadded_shape(height, width, rows * n, cols * n)
        top, left = (rows * n - keep_h) // 2, (cols * n - keep_w) // 2  # the padding was split evenly
        grid = grid[:, top : top + keep_h, left : left + keep_w]
        small = anyres.downscaled_shape(keep_h, keep_w, n, self.geo.max_tiles)
        if small != (keep_h, keep_w):  # OneVision's anyres_max_N
            grid = F.interpolate(grid[None], size=small, mode="bilinear")[0]
        grid = torch.cat([grid, newline[:, None, None].expand(hidden, grid.shape[1], 1)], dim=2)  # [hidden, h, w+1]
        return torch.cat([base, grid.flatten(1).t()])

    def video(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [F, n*n, width * layers] -> [video rows, hidden]. OneVision: project, then bilinear to
        ceil(n/2) per side, then one newline; NeXT-Video: pool by the stride, then project."""
        n, geo = self.geo.side, self.geo
        if geo.video_pool == "bilinear":
            frames = self.multi_modal_projector(frames)
        x = frames.view(frames.shape[0], n, n, -1).permute(0, 3, 1, 2)  # [F, C, n, n]
        side = geo.video_frame_side()
        if geo.video_pool == "bilinear":
            x = F.interpolate(x, size=(side, side), mode="bilinear")
        elif geo.video_pool == "average":
            x = F.avg_pool2d(x, geo.video_pool_stride, geo.video_pool_stride)
        else:
            x = F.max_pool2d(x, geo.video_pool_stride, geo.video_pool_stride)
        rows = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])  # frame by frame, row-major
        if geo.video_pool != "bilinear":
            rows = self.multi_modal_projector(rows)
        if geo.video_newline:
            rows = torch.cat([rows, self.image_newline.to(rows.dtype)[None]])
        return rows


def llama_layer(cfg: TextConfig, index: int, mlp_bias: bool) -> DecoderLayer:
    """Qwen2's layer with Llama's flags: attention_bias on q/k/v and o_proj alike, mlp_bias on the MLP."""
    return DecoderLayer(cfg, Qwen2Attention(cfg, o_bias=cfg.qkv_bias),
                        GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=mlp_bias))


class LlamaTextModel(DecoderModel):
    def __init__(self, cfg: TextConfig, mlp_bias: bool = False):
        super().__init__(cfg, partial(llama_layer, mlp_bias=mlp_bias))


def build(cfg: ModelConfig, **kw) -> VisionLanguageModel:
    def tower(_vision_cfg) -> LlavaTower:
        with building_for(SINGLE):  # whole on every rank, in either mm_encoder_tp_mode
            return LlavaTower(cfg)

    if cfg.setting(TEXT_MODEL) == "llama":
        text_cls = partial(LlamaTextModel, mlp_bias=bool(cfg.setting(MLP_BIAS)))
    else:
        text_cls = Qwen2TextModel
    return VisionLanguageModel(cfg, tower, text_cls, item_tokens=partial(item_tokens, cfg),
                               item_pixel_rows=item_pixel_rows, **kw)
