"""The decoder stack shared by the Qwen2 and Qwen3 language models: embeddings, pre-norm residual layers, final
norm, rotary angles (sectioned over the position rows) computed once per step. Each family supplies its attention
and MLP.

Tokens arrive flattened across the batch: `[T, hidden]` with `positions` `[k, T]` (M-RoPE: temporal, height,
width; plain RoPE: one row).
Attention is paged (see vlserve.model.layers.attention); the model itself holds no cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from vlserve.model.config_types import TextConfig
from vlserve.model.layers.attention import AttentionMetadata
from vlserve.model.layers.norm import RMSNorm
from vlserve.model.layers.parallel import VocabEmbedding, current_tp
from vlserve.model.layers.rotary import SectionedRotaryEmbedding


@dataclass
class SideRows:
    """A media token's rows beside its embedding (`ModelConfig.side_rows` of them), for the decoder: `features[k]`
    ([R, hidden]) goes with rows `rows` ([R]) of the flat batch. This decoder adds level k right after layer k
    (Qwen3-VL's DeepStack)."""

    rows: torch.Tensor
    features: torch.Tensor  # [side_rows, R, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: TextConfig, make_layer: Callable[[TextConfig, int], DecoderLayer]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, current_tp())
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = SectionedRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rotary_sections,
                                               cfg.rotary_interleaved, cfg.rope_scaling)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [k, T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        side: SideRows | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h = inputs_embeds
        kv_layer = 0
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, cos, sin, kv_cache, meta)
            if side is not None and i < side.features.shape[0]:
                h = h.index_add(0, side.rows, side.features[i].to(h.dtype))
            if isinstance(kv_cache, torch.Tensor):  # (a hybrid model's linear layers keep states instead)
                if meta.after_kv_layer is not None:
                    meta.after_kv_layer(kv_layer)
                kv_layer += 1
        return self.norm(h)
