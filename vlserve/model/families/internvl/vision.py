"""InternViT and InternVL's projector: every S x S tile -> its embedding rows for the language model.

A tile's patches (a linear map of each flattened (C, p, p) patch: the reference's Conv2d) follow a learned class
row; learned absolute positions are added (every tile is S x S, so the table is never resampled). Each block is
pre-norm (LayerNorm or RMSNorm) with full attention over the tile and per-channel layer scales (`lambda_1`,
`lambda_2`) on both branches; InternViT-6B also normalises the whole q and k (RMSNorm). InternVL reads the last
block's output (after `layernorm` when the tower has one), drops the class row, folds every f x f patches into
one token (the pixel shuffle, f = 1 / downsample_ratio) and projects (LayerNorm, linear, act, linear).

Tiles are a plain [tiles, rows, width] batch (no varlen). Built whole on every tensor-parallel rank (plain
nn.Linear: no tensor-parallel rules).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.config_types import ModelConfig
from vlserve.model.families.internvl.config import (
    ATTENTION_BIAS,
    FINAL_NORM,
    NORM_TYPE,
    PROJECTOR_ACT,
    QK_NORM,
    SHUFFLE,
    TILE_SIZE,
    VISION_EPS,
)
from vlserve.model.layers.mlp import get_activation
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.vision_common import attention

# On CPU the tower runs a few thousand patches at a time (a step's items may hold many 1025-row tiles).
CPU_PATCHES_PER_CALL = 4096


def _norm(kind: str, width: int, eps: float) -> nn.Module:
    return nn.LayerNorm(width, eps=eps) if kind == "layer_norm" else RMSNorm(width, eps)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.tile, self.patch, self.channels = int(cfg.setting(TILE_SIZE)), v.patch_size, v.in_channels
        side = self.tile // self.patch
        self.cls_token = nn.Parameter(torch.empty(1, 1, v.width))
        self.position_embeddings = nn.Parameter(torch.empty(1, side * side + 1, v.width))
        # the checkpoint's Conv2d kernel (`patch_embeddings.projection`), reshaped by the loader into this Linear
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(v.in_channels * v.patch_size**2, v.width)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles [N, C*S*S] (C, H, W order) -> [N, 1 + side*side, width]: the class row, then the patches."""
        n, p, c, side = tiles.shape[0], self.patch, self.channels, self.tile // self.patch
        proj = self.patch_embed.proj
        x = tiles.view(n, c, side, p, side, p).permute(0, 2, 4, 1, 3, 5).reshape(n, side * side, c * p * p)
        x = proj(x.to(proj.weight.dtype))
        x = torch.cat([self.cls_token.to(x.dtype).expand(n, 1, -1), x], dim=1)
        return x + self.position_embeddings.to(x.dtype)


class Attention(nn.Module):
    """Full attention within a tile; q/k/v in one matrix (the loader fills its three pieces)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.heads, self.head_dim, self.width = v.num_heads, v.head_dim, v.width
        self.q_size = self.kv_size = v.width  # where the loader puts the q, k and v pieces
        self.qkv = nn.Linear(v.width, 3 * v.width, bias=bool(cfg.setting(ATTENTION_BIAS)))
        self.q_norm = self.k_norm = None
        if cfg.setting(QK_NORM):
            self.q_norm, self.k_norm = RMSNorm(v.width, 1e-6), RMSNorm(v.width, 1e-6)
        self.projection_layer = nn.Linear(v.width, v.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, val = self.qkv(x).split(self.width, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, val = (t.reshape(n, length, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, val))
        out = attention(q, k, val)  # [N, heads, L, head_dim]
        return self.projection_layer(out.transpose(1, 2).reshape(n, length, self.width))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(width, hidden), nn.Linear(hidden, width), get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v, kind, eps = cfg.vision, str(cfg.setting(NORM_TYPE)), float(cfg.setting(VISION_EPS))
        self.layernorm_before = _norm(kind, v.width, eps)
        self.attn = Attention(cfg)
        self.lambda_1 = nn.Parameter(torch.empty(v.width))
        self.layernorm_after = _norm(kind, v.width, eps)
        self.mlp = MLP(v.width, v.mlp_hidden, v.hidden_act)
        self.lambda_2 = nn.Parameter(torch.empty(v.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attn(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.vision.depth))
        eps = float(cfg.setting(VISION_EPS))
        self.layernorm = nn.LayerNorm(cfg.vision.width, eps=eps) if cfg.setting(FINAL_NORM) else None

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles [N, C*S*S] -> [N, 1 + side*side, width]."""
        h = self.embeddings(tiles)
        for layer in self.layers:
            h = layer(h)
        return h if self.layernorm is None else self.layernorm(h)


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str):
        super().__init__()
        self.layer_norm = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.act = get_activation(act)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(x: torch.Tensor, f: int) -> torch.Tensor:
    """[N, side, side, C] -> [N, side/f, side/f, C*f*f] in the reference's order: each output token holds f
    columns of a row block, transposed and folded again (transformers' InternVLModel.pixel_shuffle)."""
    n, a, b, c = x.shape
    x = x.reshape(n, a, b // f, c * f).permute(0, 2, 1, 3)  # [N, b/f, a, C*f]
    x = x.reshape(n, b // f, a // f, c * f * f).permute(0, 2, 1, 3)  # [N, a/f, b/f, C*f*f]
    return x.contiguous()


class InternVLTower(nn.Module):
    """The `visual` of a VisionLanguageModel: forward(pixel_values [tiles of all items, C*S*S], grids) returns every
    item's rows one after another ([tiles * tile_tokens, hidden]); a grid's first number is its item's tiles."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.shuffle = int(cfg.setting(SHUFFLE))
        self.side = int(cfg.setting(TILE_SIZE)) // v.patch_size
        self.vision_tower = InternViT(cfg)
        self.multi_modal_projector = Projector(v.width * self.shuffle**2, cfg.text.hidden_size,
                                               str(cfg.setting(PROJECTOR_ACT)))

    @property
    def patch_embed(self) -> nn.Module:
        """The first layer (its `proj` weight dtype is what the engine reads as the tower's)."""
        return self.vision_tower.embeddings.patch_embed

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        if pixel_values.device.type == "cpu":
            chunk = max(1, CPU_PATCHES_PER_CALL // (self.side * self.side + 1))
            feats = torch.cat([self.vision_tower(part) for part in pixel_values.split(chunk)])
        else:
            feats = self.vision_tower(pixel_values)
        n, side = feats.shape[0], self.side
        feats = pixel_shuffle(feats[:, 1:].reshape(n, side, side, -1), self.shuffle)
        return self.multi_modal_projector(feats.reshape(-1, feats.shape[-1]))
