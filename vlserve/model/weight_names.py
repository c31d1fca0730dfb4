"""Our fused parameters, filled from a checkpoint's separate pieces: q/k/v projections in one `qkv_proj` (a vision
tower's q/k/v in one `qkv`), gate/up in one `gate_up_proj`. Every family's weight names end here."""

from __future__ import annotations

# (checkpoint piece, our fused piece, which shard)
FUSED_PIECES = [
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", "gate"),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", "up"),
    (".attn.q.", ".attn.qkv.", "q"),  # Qwen2.5-Omni's vision tower
    (".attn.k.", ".attn.qkv.", "k"),
    (".attn.v.", ".attn.qkv.", "v"),
]
FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "qkv": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def fused_name(name: str) -> tuple[str, str | None]:
    """(our parameter name, the shard of it this checkpoint piece fills, or None when stored whole)."""
    for piece, fused, shard in FUSED_PIECES:
        if piece in name:
            return name.replace(piece, fused), shard
    return name, None
