"""Per-sequence state of linear-attention layers (Qwen3.5's Gated DeltaNet), the counterpart of the KV cache.

A linear layer keeps, per sequence, a fixed-size state instead of one KV row per token: the last
`conv_kernel - 1` inputs of its causal conv, and the delta rule's recurrent matrix per value head. States live in
a pool of slots per layer (`LinearLayerState`); the engine gives each running sequence a slot and says, per step,
which slot each sequence of the batch uses (`LinearStateBatch`). Prefix caching keeps snapshots: copies of a
sequence's state after a block-aligned prefix, in spare slots (`checkpoints`, `copy_state_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlserve.core.errors import ConfigurationError
from vlserve.model.accelerator import to_device
from vlserve.model.config_types import TextConfig


@dataclass
class LinearLayerState:
    """One linear-attention layer's state pool (this rank's heads)."""

    conv: torch.Tensor  # [num_slots, conv_dim, conv_kernel - 1], model dtype
    recurrent: torch.Tensor  # [num_slots, num_value_heads, key_head_dim, value_head_dim], float32


@dataclass
class LinearStateBatch:
    """Which state slot each sequence of one step uses; built by the engine, the same on every rank."""

    slots: torch.Tensor  # [num_seqs] int64, batch order: decode rows first, then prefill spans
    fresh: torch.Tensor  # [num_seqs] bool: start from a zero state (the chunk starts at token 0)
    # Per prefill span: (n, slot) = after the first n tokens of this chunk (1 <= n <= chunk length) copy the
    # layer's conv and recurrent state into `slot` (a prefix-cache snapshot).
    checkpoints: list[list[tuple[int, int]]] = field(default_factory=list)


def _local_heads(cfg: TextConfig, tp: int) -> tuple[int, int]:
    la = cfg.linear_attention
    if la.num_key_heads % tp or la.num_value_heads % tp:
        raise ConfigurationError(f"linear attention heads ({la.num_key_heads} key, {la.num_value_heads} value) do "
                                 f"not split evenly over tensor_parallel_size={tp}")
    return la.num_key_heads // tp, la.num_value_heads // tp


def _shapes(cfg: TextConfig, tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-slot shapes of (conv, recurrent) on one rank."""
    la = cfg.linear_attention
    kh, vh = _local_heads(cfg, tp)
    conv_dim = 2 * kh * la.key_head_dim + vh * la.value_head_dim
    return (conv_dim, la.conv_kernel - 1), (vh, la.key_head_dim, la.value_head_dim)


def new_layer_states(cfg: TextConfig, num_slots: int, dtype: torch.dtype, device, tp: int = 1
                     ) -> list[LinearLayerState | None]:
    """One entry per decoder layer: a zeroed pool of `num_slots` states for a linear layer, None otherwise."""
    if cfg.linear_attention is None:
        return [None] * cfg.num_layers
    conv_shape, rec_shape = _shapes(cfg, tp)
    return [LinearLayerState(torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device),
                             torch.zeros(num_slots, *rec_shape, dtype=torch.float32, device=device))
            if cfg.is_linear_layer(i) else None for i in range(cfg.num_layers)]


def state_bytes_per_slot(cfg: TextConfig, dtype: torch.dtype, ranks: int = 1) -> int:
    """Bytes one slot takes across every linear layer, on one rank."""
    if cfg.linear_attention is None:
        return 0
    (cd, ck), (vh, kd, vd) = _shapes(cfg, ranks)
    per_layer = cd * ck * torch.empty((), dtype=dtype).element_size() + vh * kd * vd * 4
    return per_layer * sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers))


def copy_state_slots(states: list[LinearLayerState | None], pairs: list[tuple[int, int]]) -> None:
    """Copy slot src to slot dst in every linear layer, for each (src, dst) in order."""
    if not pairs:
        return
    srcs, dsts = [p[0] for p in pairs], [p[1] for p in pairs]
    batched = len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts)  # else chained: one at a time, in order
    index: dict = {}
    for st in states:
        if st is None:
            continue
        if not batched:
            for s, d in pairs:
                st.conv[d].copy_(st.conv[s])
                st.recurrent[d].copy_(st.recurrent[s])
            continue
        dev = st.conv.device
        if dev not in index:
            index[dev] = (to_device(torch.tensor(srcs, dtype=torch.long), dev),
                          to_device(torch.tensor(dsts, dtype=torch.long), dev))
        src, dst = index[dev]
        st.conv.index_copy_(0, dst, st.conv.index_select(0, src))
        st.recurrent.index_copy_(0, dst, st.recurrent.index_select(0, src))
