"""Qwen2 decoder with multimodal RoPE (M-RoPE), as used by Qwen2-VL and Qwen2.5-VL: biased fused q/k/v, a SwiGLU
MLP in every layer."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.decoder import DecoderLayer, DecoderModel
from vlserve.model.config_types import TextConfig
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.parallel import column_linear, current_tp, head_split, row_linear
from vlserve.model.layers.rotary import rotate_heads_


class Qwen2Attention(nn.Module):
    """Under tensor parallelism each rank keeps whole query heads and the key/value heads they use (copies when
    there are fewer key/value heads than ranks); o_proj's partial sums are reduced over ranks."""

    def __init__(self, cfg: TextConfig, o_bias: bool = False):
        super().__init__()
        self.tp = tp = current_tp()
        self.head_dim = cfg.head_dim
        q = head_split(cfg.num_heads, cfg.head_dim, tp, "attention heads")
        kv = head_split(cfg.num_kv_heads, cfg.head_dim, tp, "key/value heads", copies=True)
        self.q_size, self.kv_size = q.size, kv.size
        self.num_heads, self.num_kv_heads = q.size // self.head_dim, kv.size // self.head_dim
        self.qkv_proj = column_linear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias)
        self.o_proj = row_linear(q, cfg.hidden_size, o_bias, tp)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent in the fused projection: rotate them in one pass, in place
        rotate_heads_(qkv, cos, sin, self.num_heads + self.num_kv_heads)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.tp.all_reduce(self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale)))


def qwen2_layer(cfg: TextConfig, index: int) -> DecoderLayer:
    return DecoderLayer(cfg, Qwen2Attention(cfg), GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", bias=False))


class Qwen2TextModel(DecoderModel):
    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, qwen2_layer)
