"""Qwen3 decoder as used by Qwen3-VL and Qwen3-VL-MoE: per-head q/k RMSNorm before RoPE, no attention bias,
interleaved M-RoPE, a dense or sparse (MoE) MLP per layer, and DeepStack: visual features from several ViT depths
added to the hidden states right after the first decoder layers, at visual positions only.

Tokens arrive flattened across the batch: `[T, hidden]` with `positions` `[3, T]`; attention is paged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from vlserve.model.hf_config import TextConfig
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.moe import SparseMoE
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.layers.rotary import MRotaryEmbedding, apply_rotary


@dataclass
class DeepstackInput:
    """What DeepStack adds in one forward pass: `features[k]` ([R, hidden]) onto rows `rows` ([R]) of the flat
    batch, right after decoder layer k."""

    rows: torch.Tensor
    features: torch.Tensor  # [levels, R, hidden]


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)  # `attention_bias` covers both
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(T, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_sparse_layer(index):
            m = cfg.moe
            self.mlp = SparseMoE(cfg.hidden_size, m.intermediate_size, m.num_experts, m.top_k, cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        deepstack: DeepstackInput | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h = inputs_embeds
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, cos, sin, kv_cache, meta)
            if deepstack is not None and i < deepstack.features.shape[0]:
                h = h.index_add(0, deepstack.rows, deepstack.features[i].to(h.dtype))
        return self.norm(h)
