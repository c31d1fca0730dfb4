"""The LLaVA vision encoders: SigLIP (LLaVA-OneVision) and CLIP (LLaVA-NeXT-Video), one pre-LayerNorm ViT.

Every tile is one S x S picture, so the tiles of a batch are a plain [tiles, patches, width] batch (no varlen).
CLIP prepends a learned class row and normalizes the embeddings (`pre_layrnorm`) before the blocks; SigLIP's
patch embedding has a bias. LLaVA reads the hidden states after given blocks (`vision_feature_layer`, 0 = the
embeddings), never the final `post_layernorm` (or SigLIP's pooling head): only the blocks up to the deepest
layer read run. Built whole on every tensor-parallel rank (plain nn.Linear: no tensor-parallel rules).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.config_types import VisionConfig
from vlserve.model.layers.mlp import get_activation
from vlserve.model.vision_common import attention


class PatchEmbed(nn.Module):
    """The reference's Conv2d with kernel = stride = patch: a linear map of each flattened (C, p, p) patch (the
    loader reshapes the conv kernel into this Linear's weight)."""

    def __init__(self, cfg: VisionConfig, bias: bool):
        super().__init__()
        self.patch, self.channels = cfg.patch_size, cfg.in_channels
        self.proj = nn.Linear(cfg.in_channels * cfg.patch_size**2, cfg.width, bias=bias)

    def forward(self, tiles: torch.Tensor, side: int) -> torch.Tensor:
        """tiles [N, C*S*S] (C, H, W order) -> [N, side*side, width], patches in row-major order."""
        n, p, c = tiles.shape[0], self.patch, self.channels
        x = tiles.view(n, c, side, p, side, p).permute(0, 2, 4, 1, 3, 5).reshape(n, side * side, c * p * p)
        return self.proj(x.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Full multi-head attention within each tile; q/k/v in one matrix (the loader fills its three pieces)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_size = self.kv_size = cfg.width  # where the loader puts the q, k and v pieces
        self.qkv_proj = nn.Linear(cfg.width, 3 * cfg.width, bias=True)
        self.out_proj = nn.Linear(cfg.width, cfg.width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, width = x.shape
        qkv = self.qkv_proj(x).view(n, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = attention(qkv[0], qkv[1], qkv[2])  # [N, heads, L, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.width)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """SigLIP or CLIP vision transformer; `forward` returns the hidden states after `feature_layers` blocks,
    concatenated along the width."""

    def __init__(self, cfg: VisionConfig, kind: str, image_size: int, eps: float, feature_layers: tuple[int, ...]):
        super().__init__()
        self.side = image_size // cfg.patch_size
        self.clip = kind == "clip"
        self.feature_layers = feature_layers
        self.patch_embed = PatchEmbed(cfg, bias=not self.clip)
        positions = self.side**2 + int(self.clip)
        self.class_embedding = nn.Parameter(torch.empty(cfg.width)) if self.clip else None
        self.position_embedding = nn.Embedding(positions, cfg.width)
        self.pre_layrnorm = nn.LayerNorm(cfg.width, eps=eps) if self.clip else None  # (sic: the checkpoints' name)
        # the blocks past the deepest layer read are built (their weights are in the checkpoint) but never run
        self.layers = nn.ModuleList(EncoderLayer(cfg, eps) for _ in range(cfg.depth))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles [N, C*S*S] -> [N, rows, width * len(feature_layers)] (rows: CLIP's class row, then the patches)."""
        h = self.patch_embed(tiles, self.side)  # [N, n*n, width]
        if self.clip:
            h = torch.cat([self.class_embedding.to(h.dtype).expand(h.shape[0], 1, -1), h], dim=1)
        h = h + self.position_embedding.weight
        if self.clip:
            h = self.pre_layrnorm(h)
        picked = {0: h}
        for i, layer in enumerate(self.layers[: max(self.feature_layers)], start=1):
            h = layer(h)
            if i in self.feature_layers:
                picked[i] = h
        return torch.cat([picked[i] for i in self.feature_layers], dim=-1)
