"""Qwen2 decoder with multimodal RoPE (M-RoPE), as used by Qwen2-VL and Qwen2.5-VL.

Tokens arrive flattened across the batch: `[T, hidden]` with `positions` `[3, T]` (temporal, height, width).
Attention is paged (see vlserve.model.layers.attention); the model itself holds no cache.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model.hf_config import TextConfig
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.layers.rotary import MRotaryEmbedding, apply_rotary


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
        # q and k heads are adjacent in the fused projection: rotate them in one pass
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", bias=False)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.norm(h)
