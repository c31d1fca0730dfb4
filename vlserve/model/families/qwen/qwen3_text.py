"""Qwen3 decoder as used by Qwen3-VL and Qwen3-VL-MoE: per-head q/k RMSNorm before RoPE, no attention bias,
interleaved M-RoPE, a dense or sparse (MoE) MLP per layer. DeepStack (visual features from several ViT depths
added after the first decoder layers, at visual positions only) arrives as the stack's `SideRows`."""

from __future__ import annotations

import torch

from vlserve.model.config_types import TextConfig
from vlserve.model.decoder import DecoderLayer, DecoderModel
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.moe import SparseMoE
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.layers.rotary import rotate_heads_
from vlserve.model.qwen2_text import Qwen2Attention


class Qwen3Attention(Qwen2Attention):
    """Qwen2's fused projections (biases only with `attention_bias`, then on o_proj too) plus RMSNorm per q/k head."""

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, o_bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rotate_heads_(self.q_norm(q.view(T, self.num_heads, self.head_dim)), cos, sin, self.num_heads)
        k = rotate_heads_(self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)), cos, sin, self.num_kv_heads)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale)))


def qwen3_layer(cfg: TextConfig, index: int) -> DecoderLayer:
    if cfg.is_sparse_layer(index):
        m = cfg.moe
        mlp = SparseMoE(cfg.hidden_size, m.intermediate_size, m.num_experts, m.top_k, cfg.hidden_act)
    else:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
    return DecoderLayer(cfg, Qwen3Attention(cfg), mlp)


class Qwen3TextModel(DecoderModel):
    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, qwen3_layer)
