"""Qwen2 decoder with multimodal RoPE (M-RoPE), as used by Qwen2-VL and Qwen2.5-VL: biased fused q/k/v, a SwiGLU
MLP in every layer."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.decoder import DecoderLayer, DecoderModel
from vlserve.model.hf_config import TextConfig
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.rotary import rotate_heads_


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent in the fused projection: rotate them in one pass, in place
        rotate_heads_(qkv, cos, sin, self.num_heads + self.num_kv_heads)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale))


def qwen2_layer(cfg: TextConfig, index: int) -> DecoderLayer:
    return DecoderLayer(cfg, Qwen2Attention(cfg), GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", bias=False))


class Qwen2TextModel(DecoderModel):
    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, qwen2_layer)
