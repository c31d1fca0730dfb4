"""Qwen3.5's hybrid decoder: most layers mix tokens with a Gated DeltaNet (linear attention with a fixed-size
per-sequence state), every few layers with gated full attention over the paged KV cache. Every decoder RMSNorm is
zero-centred (scale 1 + w). The MLP is dense (Qwen3.5) or sparse with a gated shared expert (Qwen3.5-MoE).

For this model `kv_caches[i]` is a KV tensor for a full-attention layer and a `LinearLayerState` (the pool of
per-sequence states) for a linear one; `meta.linear` says which state slot each sequence of the step uses.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.model.config_types import TextConfig
from vlserve.model.decoder import DecoderModel
from vlserve.model.layers.attention import AttentionMetadata, paged_attention
from vlserve.model.layers.gated_delta import causal_conv, causal_conv_step, chunk_gated_delta, gated_delta_step_in_pool
from vlserve.model.layers.linear_state import LinearLayerState
from vlserve.model.layers.mlp import GatedMLP
from vlserve.model.layers.moe import SparseMoE
from vlserve.model.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm
from vlserve.model.layers.parallel import Column, column_linear, current_tp, even_split, head_split, row_linear
from vlserve.model.layers.rotary import SectionedRotaryEmbedding, rotate_heads_


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields an output gate (per head: head_dim query columns, then head_dim
    gate columns); q/k RMSNorm per head; rotary on the first `rotary_dim` dims of each head only."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.tp = tp = current_tp()
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        q = head_split(cfg.num_heads, 2 * cfg.head_dim, tp, "attention heads")  # query + gate
        kv = head_split(cfg.num_kv_heads, cfg.head_dim, tp, "key/value heads", copies=True)
        self.q_size, self.kv_size = q.size, kv.size  # the loader's row offsets of q_proj / k_proj / v_proj
        self.num_heads, self.num_kv_heads = q.size // (2 * self.head_dim), kv.size // self.head_dim
        self.qkv_proj = column_linear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias)
        self.o_proj = row_linear(head_split(cfg.num_heads, cfg.head_dim, tp, "attention heads"), cfg.hidden_size,
                                 cfg.qkv_bias, tp)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, hd, rd = x.shape[0], self.head_dim, self.rotary_dim
        q_gate, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(T, self.num_heads, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, hd))
        # A partial rotary view is strided per head: rotate_heads_ then takes its torch path, in place.
        rotate_heads_(q[..., :rd], cos, sin, self.num_heads)
        rotate_heads_(k[..., :rd], cos, sin, self.num_kv_heads)
        out = paged_attention(q, k, v.view(T, self.num_kv_heads, hd), kv_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out * torch.sigmoid(gate.reshape(T, -1))))


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj_qkv -> causal depthwise conv (silu) -> q, k, v heads; the gated delta rule with
    decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b); a gated RMSNorm per value
    head (gate z); out_proj. Decode rows run one batched recurrence step, each prefill span the chunked form."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        la = cfg.linear_attention
        self.la, self.tp = la, (tp := current_tp())
        # Tensor parallel: each rank keeps whole key heads and the value heads that use them (value head j reads
        # key head j // (value heads per key head), so even splits of both stay together); out_proj's partial sums
        # are all-reduced. At one rank every split is whole.
        keys = head_split(la.num_key_heads, la.key_head_dim, tp, "linear-attention key heads")
        values = head_split(la.num_value_heads, la.value_head_dim, tp, "linear-attention value heads")
        heads = even_split(la.num_value_heads, tp, "linear-attention value heads")
        self.num_key_heads, self.num_value_heads = keys.size // la.key_head_dim, heads.size
        self.key_size, self.value_size = keys.size, values.size
        conv = {"q": keys, "k": keys, "v": values}  # the conv channels are in_proj_qkv's outputs, split alike
        self.in_proj_qkv = column_linear(cfg.hidden_size, conv, bias=False)
        self.in_proj_z = column_linear(cfg.hidden_size, {"": values}, bias=False)
        self.in_proj_b = column_linear(cfg.hidden_size, {"": heads}, bias=False)
        self.in_proj_a = column_linear(cfg.hidden_size, {"": heads}, bias=False)
        conv_dim = 2 * keys.size + values.size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, la.conv_kernel, groups=conv_dim, bias=False)
        self.conv1d.tp_rules = {"weight": Column(conv)}
        self.dt_bias = nn.Parameter(torch.ones(heads.size))
        self.A_log = nn.Parameter(torch.zeros(heads.size))
        self.tp_rules = {"dt_bias": Column({"": heads}), "A_log": Column({"": heads})}
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = row_linear(values, cfg.hidden_size, False, tp)

    def _heads(self, mixed: torch.Tensor):
        la, n = self.la, mixed.shape[0]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (q.view(n, self.num_key_heads, la.key_head_dim), k.view(n, self.num_key_heads, la.key_head_dim),
                v.view(n, self.num_value_heads, la.value_head_dim))

    def forward(self, x, cos, sin, state: LinearLayerState, meta: AttentionMetadata) -> torch.Tensor:
        lin = meta.linear
        if lin is None:
            raise ValueError("a hybrid model's step needs AttentionMetadata.linear (the state slots)")
        T, la = x.shape[0], self.la
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, kernel]
        core = x.new_zeros(T, self.num_value_heads, la.value_head_dim)
        nd = meta.num_decode_tokens
        if nd:
            slots, fresh = lin.slots[:nd], lin.fresh[:nd]
            conv = torch.where(~fresh[:, None, None], state.conv.index_select(0, slots), 0)
            out, conv = causal_conv_step(mixed[:nd], weight, conv)
            core[:nd] = gated_delta_step_in_pool(*self._heads(out), g[:nd], beta[:nd], state.recurrent, slots, fresh)
            state.conv.index_copy_(0, slots, conv.to(state.conv.dtype))
        width = la.conv_kernel - 1
        for j, span in enumerate(meta.prefills):
            seq, rows = nd + j, slice(span.start, span.start + span.num_tokens)
            slot, keep = lin.slots[seq : seq + 1], ~lin.fresh[seq]
            conv = torch.where(keep, state.conv.index_select(0, slot)[0], 0)
            rec = torch.where(keep, state.recurrent.index_select(0, slot)[0], 0)
            checkpoints = lin.checkpoints[j] if j < len(lin.checkpoints) else []
            out, window = causal_conv(mixed[rows], weight, conv)
            core[rows], rec, snapshots = chunk_gated_delta(*self._heads(out), g[rows], beta[rows], rec,
                                                           [n for n, _ in checkpoints])
            state.conv.index_copy_(0, slot, window[None, :, -width:].to(state.conv.dtype))
            state.recurrent.index_copy_(0, slot, rec[None])
            for (n, dst), snapshot in zip(checkpoints, snapshots):  # prefix-cache snapshots after n tokens
                state.conv[dst].copy_(window[:, n : n + width])
                state.recurrent[dst].copy_(snapshot)
        out = self.norm(core.view(-1, la.value_head_dim), z.view(-1, la.value_head_dim))
        return self.tp.all_reduce(self.out_proj(out.view(T, self.value_size)))


class HybridLayer(nn.Module):
    """Pre-norm residual layer; `linear_attn` or `self_attn` as the checkpoint names them."""

    def __init__(self, cfg: TextConfig, index: int):
        super().__init__()
        self.is_linear = cfg.is_linear_layer(index)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m = cfg.moe
        if cfg.is_sparse_layer(index):
            self.mlp = SparseMoE(cfg.hidden_size, m.intermediate_size, m.num_experts, m.top_k, cfg.hidden_act,
                                 shared_intermediate=m.shared_expert_intermediate_size)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)

    def forward(self, x, cos, sin, cache, meta):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5TextModel(DecoderModel):
    """The shared stack (embeddings, layers, final norm, M-RoPE angles) with Qwen3.5's layers, zero-centred final
    norm and rotary angles for the rotated part of each head only."""

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, HybridLayer)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = SectionedRotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rotary_sections,
                                               cfg.rotary_interleaved)
